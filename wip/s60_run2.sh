#!/bin/bash
# The activation benchmark and the training step with the one-pass kernel (tree as committed).
export PYTHONPATH=.
name=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$name"
case "$name" in *H200*) tag=h200;; *) tag=h100;; esac
timeout 170 python3 benchmarks/activation.py --shapes qwen3_30b,mixtral,dsv3_ep8 --tag s60_$tag --out $OUT > $OUT/act.log 2>&1; echo "act rc $?"
grep -v -i warn $OUT/act.log | tail -12 | cut -c1-250
timeout 400 python3 benchmarks/layer.py --shapes mixtral,dsv3_ep8 --modes train --impls jaxmoe_bf16,jaxmoe_fp8_blockwise,jaxmoe_fp8_blockwise_cached_weights --tag s60_$tag --out $OUT > $OUT/layer.log 2>&1
echo "layer rc $?"
grep -v -i warn $OUT/layer.log | tail -24 | cut -c1-220
