#!/bin/bash
# Session 61: the FP8-blockwise GPU suite on the branch (kernels, the route, the three layers).
export PYTHONPATH=.
nvidia-smi --query-gpu=name --format=csv,noheader
tools/gpu_suite.sh $OUT 470 \
  "w:0.12:-m gpu tests/test_fp8_blockwise.py tests/test_quantize_transpose_pallas.py tests/test_swiglu_backward_quantize_pallas.py tests/test_swiglu_quantize_pallas.py tests/test_activation_pallas.py tests/test_gpu_route.py" \
  "m:0.3:tests/test_gpu_layer.py --layer-shapes mixtral --layer-precisions fp8_blockwise" \
  "d:0.25:tests/test_gpu_layer.py --layer-shapes dsv3_ep8 --layer-precisions fp8_blockwise" \
  "q:0.25:tests/test_gpu_layer.py --layer-shapes qwen3_30b --layer-precisions fp8_blockwise"
python3 -c "
import json; r=json.load(open('$OUT/gpu_suite.json')); t=r.get('tests', [])
print(r.get('summary')); [print(x.get('nodeid'), x.get('outcome')) for x in t if x.get('outcome')!='passed']
"
