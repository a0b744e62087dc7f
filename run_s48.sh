#!/bin/bash
export PYTHONPATH=. JAXMOE_GIT_COMMIT=${JAXMOE_GIT_COMMIT:-wip}
nvidia-smi --query-gpu=name --format=csv
tools/gpu_suite.sh $OUT 280 "qf:0.2:-m gpu tests/test_quantize_pallas.py -k float" "qe:0.2:-m gpu tests/test_quantize_pallas.py -k exact" "qt:0.2:-m gpu tests/test_quantize_transpose_pallas.py" "qb:0.2:-m gpu tests/test_quantize_1x128_pallas.py tests/test_fp8_blockwise.py"
python -c "import json; d=json.load(open('$OUT/gpu_suite.json')); print({k: v for k, v in d.items() if k in ('passed','failed','summary','totals')})"
