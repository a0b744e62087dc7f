export PYTHONPATH=. PYTHONUNBUFFERED=1 JAXMOE_GIT_COMMIT=bbfc960
ln -sf $(which python3) /usr/local/bin/python
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv > $OUT/smi.txt
timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_e4m3_registers.py -x > $OUT/test.log 2>&1; echo "test exit $?" >> $OUT/test.log
tail -5 $OUT/test.log
timeout 330 python benchmarks/decode.py --parts gmm --tokens 64 --shapes qwen3_30b,mixtral,dsv3_ep8 --impls gmm_bf16,gmm_mxfp8_decode,gmm_mxfp8_decode_small_scales --profile --tag s29_small --out $OUT > $OUT/bench.log 2>&1; echo "bench exit $?"
grep -E "gmm_|bandwidth" $OUT/bench.log | tail -20
