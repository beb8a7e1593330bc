#!/usr/bin/env bash
# GPU checks for the parameter server, in one go, on a machine with CUDA:
#   1. the CUDA-gated tests (they skip without a GPU elsewhere),
#   2. the PS service tests against CUDA tables,
#   3. the pull/push throughput bench with device=cuda tables.
# Usage: bash bench/gpu_check.sh [--quick]     (from the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python
OUT=${OUT:-/tmp}
QUICK=${1:-}

"$PY" - <<'PY'
import torch
assert torch.cuda.is_available(), "bench/gpu_check.sh needs a CUDA GPU (torch.cuda.is_available() is False)"
print("cuda:", torch.cuda.get_device_name(0), "torch", torch.__version__)
PY

echo "== CUDA-gated tests"
# Every test that checks torch.cuda.is_available() (they run instead of skipping here).
mapfile -t CUDA_TESTS < <(grep -rl "cuda.is_available" tests --include='test_*.py' || true)
if [ "${#CUDA_TESTS[@]}" -gt 0 ]; then
  timeout 900 "$PY" -m pytest -q -rs "${CUDA_TESTS[@]}" 2>&1 | tee "$OUT/gpu_tests.log"
fi

echo "== PS service tests (tables on cuda via METAPS_PS_DEVICE)"
METAPS_PS_DEVICE=cuda timeout 900 "$PY" -m pytest -q tests/ps/test_routing.py tests/ps/test_client.py \
  tests/ps/test_migration.py 2>&1 | tee "$OUT/gpu_ps_tests.log"

echo "== PS throughput bench, device=cuda"
timeout 900 "$PY" -m bench.ps_throughput $QUICK --device cuda 2>&1 | tee "$OUT/gpu_ps_bench.log"
tail -n 1 "$OUT/gpu_ps_bench.log" > "$OUT/gpu_ps_bench.json"
