#!/bin/bash
# Session 61: the bwdq probe (s60), the forward copies probe, the GPU tests of both kernels and
# the mixtral FP8-blockwise layer.
export PYTHONPATH=.
nvidia-smi --query-gpu=name --format=csv,noheader
MOSAIC_GPU_DUMP_PTXAS=1 timeout 150 python wip/s60_probe.py > $OUT/probe.log 2>&1; echo "probe rc $?"
grep -E "^(mixtral|dsv3_ep8|qwen3_30b) " $OUT/probe.log | cut -c1-2500
grep -iE "registers|spill" $OUT/probe.log | sort | uniq -c | head -12
MOSAIC_GPU_DUMP_PTXAS=1 timeout 100 python wip/s61_fwd_probe.py > $OUT/fwd_probe.log 2>&1; echo "fwd probe rc $?"
grep -E "^(mixtral|dsv3_ep8|qwen3_30b) " $OUT/fwd_probe.log | cut -c1-2500
grep -iE "registers|spill" $OUT/fwd_probe.log | sort | uniq -c | head -12
tools/gpu_suite.sh $OUT 250 \
  "k:0.35:-m gpu tests/test_swiglu_backward_quantize_pallas.py tests/test_swiglu_quantize_pallas.py tests/test_activation_pallas.py" \
  "m:0.6:tests/test_gpu_layer.py --layer-shapes mixtral --layer-precisions fp8_blockwise"
python3 -c "
import json; r=json.load(open('$OUT/gpu_suite.json')); t=r.get('tests', [])
print(r.get('summary')); [print(x.get('nodeid'), x.get('outcome')) for x in t if x.get('outcome')!='passed']
"
