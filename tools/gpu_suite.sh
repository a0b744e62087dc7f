#!/usr/bin/env bash
# The GPU test suite as run on a one-GPU machine: each case in its own process, in parallel, with
# its share of GPU memory, then one merged record; every log and part packed in one archive (a
# device machine returns few files).
#
#   tools/gpu_suite.sh OUT_DIR SECONDS CASE [CASE ...]
#
# CASE: NAME:MEMORY_FRACTION:PYTEST_ARGS..., e.g.
#   "q:0.2:tests/gpu/test_gpu_layer.py --layer-shapes qwen3_30b --layer-precisions bf16,mxfp8"
#   "kernels:0.1:-m gpu tests/kernels/test_gmm_pallas.py"
# Each case runs under `timeout SECONDS`; its records are written after every test, so a case cut
# by the limit keeps what it finished. A case prints its lowering and compile times as it goes
# (tests/gpu/test_gpu_layer.py), into OUT_DIR/NAME.log. Writes OUT_DIR/gpu_suite.json (merged,
# tools/merge_suite_results.py) and OUT_DIR/gpu_suite_parts.tar.gz (logs and parts).
# JAXMOE_GIT_COMMIT names the tree when the copy's .git lags behind it.
set -uo pipefail
out=$1 seconds=$2
shift 2
cd "$(dirname "$0")/.."
work=$(mktemp -d)
for case in "$@"; do
  name=${case%%:*} rest=${case#*:}
  fraction=${rest%%:*} args=${rest#*:}
  # shellcheck disable=SC2086  # the pytest arguments are words
  (XLA_PYTHON_CLIENT_MEM_FRACTION=$fraction timeout "$seconds" python -m pytest -q -p no:cacheprovider \
     $args --results-json "$work/$name.json" > "$work/$name.log" 2>&1
   echo "$name: exit $?" >> "$work/exits.txt") &
done
wait
parts=("$work"/*.json)
if [ -e "${parts[0]}" ]; then
  python tools/merge_suite_results.py "$out/gpu_suite.json" "${parts[@]}"
fi
tar -czf "$out/gpu_suite_parts.tar.gz" -C "$work" .
cat "$work/exits.txt"
