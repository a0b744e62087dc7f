#!/bin/bash
export PYTHONPATH=.
nvidia-smi --query-gpu=name --format=csv,noheader
SHAPES=mixtral,dsv3_ep8 TURNS=3 MOSAIC_GPU_DUMP_PTXAS=1 timeout 110 python wip/s60_probe.py > $OUT/probe.log 2>&1; echo "probe rc $?"
grep -E "^(mixtral|dsv3_ep8|qwen3_30b) " $OUT/probe.log | cut -c1-3000
grep -iE "registers|spill" $OUT/probe.log | sort | uniq -c | head -20
tools/gpu_suite.sh $OUT 140 "k:0.5:-m gpu tests/test_swiglu_backward_quantize_pallas.py tests/test_activation_pallas.py"
python3 -c "
import json; r=json.load(open('$OUT/gpu_suite.json')); t=r.get('tests', [])
print(r.get('summary')); [print(x.get('nodeid'), x.get('outcome')) for x in t if x.get('outcome')!='passed']
"
