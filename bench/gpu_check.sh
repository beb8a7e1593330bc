#!/usr/bin/env bash
# GPU checks in one go, on a machine with CUDA and the GPU install set
# (requirements/gpu.txt: CUDA torch 2.13 + fbgemm-gpu 1.8.0; docs/operations.md, "GPU install"):
#   1. every CUDA-gated test (tests that check torch.cuda.is_available(); they take their CUDA branch),
#   2. the PS service tests against CUDA tables (METAPS_PS_DEVICE=cuda),
#   3. bench.ps_storage --device cuda (store pull/push on CUDA tables),
#   4. bench.ps_throughput --device cuda (gRPC pull/push against CUDA tables),
#   5. bench.meta_step --device cuda (vmap vs per-task loop on the GPU).
# Everything goes to one log, $OUT/gpu_check.log (OUT defaults to /tmp); the last line of each
# bench (its JSON) is also kept as $OUT/gpu_<bench>.json. Exits non-zero if any step failed.
# Usage: bash bench/gpu_check.sh [--quick]     (from the repository root)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python
OUT=${OUT:-/tmp}
QUICK=${1:-}
LOG="$OUT/gpu_check.log"
mkdir -p "$OUT"
exec > >(tee "$LOG") 2>&1
FAILED=()

step() {  # step NAME CMD...: run, record failure, keep going
  local name=$1; shift
  echo "== $name: $*"
  if ! "$@"; then FAILED+=("$name"); echo "== $name FAILED"; fi
}

"$PY" - <<'PY' || { echo "no usable CUDA: stopping"; exit 2; }
import torch, fbgemm_gpu  # noqa: F401
assert torch.cuda.is_available(), "bench/gpu_check.sh needs a CUDA GPU (torch.cuda.is_available() is False)"
print("cuda:", torch.cuda.get_device_name(0), "torch", torch.__version__, "cuda", torch.version.cuda)
PY

mapfile -t CUDA_TESTS < <(grep -rl "cuda.is_available" tests --include='test_*.py' | sort)
step cuda-tests timeout 900 "$PY" -m pytest -q -rs "${CUDA_TESTS[@]}"
step ps-service-tests env METAPS_PS_DEVICE=cuda timeout 900 "$PY" -m pytest -q tests/ps/test_routing.py \
  tests/ps/test_client.py tests/ps/test_migration.py

bench() {  # bench NAME ARGS...: run python -m bench.NAME ARGS, keep its JSON line
  local name=$1; shift
  timeout 900 "$PY" -m "bench.$name" "$@" | tee "$OUT/gpu_$name.out" && tail -n 1 "$OUT/gpu_$name.out" > "$OUT/gpu_$name.json"
}
step ps_storage bench ps_storage $QUICK --device cuda
step ps_throughput bench ps_throughput $QUICK --device cuda
step meta_step bench meta_step $QUICK --device cuda

if [ "${#FAILED[@]}" -gt 0 ]; then echo "== gpu_check: FAILED: ${FAILED[*]} (log: $LOG)"; exit 1; fi
echo "== gpu_check: all passed (log: $LOG)"
