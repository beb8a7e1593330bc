#!/usr/bin/env bash
# Install metaps and its locked dependencies into one Python environment: the single install
# procedure shared by `make install` and both images (docker/Dockerfile, docker/Dockerfile.cuda),
# so an image holds exactly what `make` installs on a machine.
#
#   scripts/install.sh [--python PY] [--variant cpu|gpu] [--extras EXTRAS] [--editable] [--dry-run]
#
#   --python PY      the environment's interpreter (default: python3 on PATH)
#   --variant cpu    requirements/lock.txt + lock-cpu.txt: torch 2.13 CPU + fbgemm-gpu-cpu (default)
#   --variant gpu    requirements/lock.txt + gpu.txt: a CUDA torch 2.13 + fbgemm-gpu 1.8.0
#                    (TORCH_INDEX_URL, e.g. https://download.pytorch.org/whl/cu126, picks the CUDA build)
#   --extras E       further extras, comma separated; `test` adds requirements/lock-test.txt
#   --editable       pip install -e (a development checkout; `make install`); default: a regular install
#   --dry-run        print the pip commands, run nothing
# The locked files (scripts/lock.py writes them) pin every package with its sha256 and install
# with --require-hashes --no-deps; metaps itself then installs without resolving anything, and
# `pip check` proves the set is whole. Never both variants in one environment: fbgemm-gpu-cpu and
# fbgemm-gpu both ship `fbgemm_gpu`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY=python3 VARIANT=cpu EXTRAS="" EDITABLE=0 DRY=0
die() { echo "install.sh: error: $*" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python) PY="$2"; shift 2 ;;
    --variant) VARIANT="$2"; shift 2 ;;
    --extras) EXTRAS="$2"; shift 2 ;;
    --editable) EDITABLE=1; shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ "$VARIANT" == cpu || "$VARIANT" == gpu ]] || die "--variant must be cpu or gpu, got '$VARIANT'"
[[ -f "$ROOT/requirements/$VARIANT.txt" ]] || die "$ROOT/requirements/$VARIANT.txt: no such file"
[[ -z "$EXTRAS" || "$EXTRAS" =~ ^[A-Za-z0-9_,-]+$ ]] || die "--extras must be names separated by commas, got '$EXTRAS'"

ALL="$VARIANT${EXTRAS:+,$EXTRAS}"
run() {
  echo "+ $*"
  [[ "$DRY" == 1 ]] || "$@"
}
TORCH_ARGS=()
[[ -n "${TORCH_INDEX_URL:-}" ]] && TORCH_ARGS=(--extra-index-url "$TORCH_INDEX_URL")
LOCKS=(-r "$ROOT/requirements/lock.txt")
[[ "$VARIANT" == cpu ]] && LOCKS+=(-r "$ROOT/requirements/lock-cpu.txt")
IFS=, read -r -a EXTRA_LIST <<< "$EXTRAS"
for e in "${EXTRA_LIST[@]}"; do
  [[ -f "$ROOT/requirements/lock-$e.txt" ]] || die "extra '$e' has no lock file requirements/lock-$e.txt (run scripts/lock.py)"
  LOCKS+=(-r "$ROOT/requirements/lock-$e.txt")
done
run "$PY" -m pip install -q "${TORCH_ARGS[@]}" --require-hashes --no-deps "${LOCKS[@]}"
# The CUDA kernels are pinned by version (torch pins its CUDA libraries exactly); see scripts/lock.py.
if [[ "$VARIANT" == gpu ]]; then
  run "$PY" -m pip install -q "${TORCH_ARGS[@]}" -r "$ROOT/requirements/gpu.txt"
fi
if [[ "$EDITABLE" == 1 ]]; then
  run "$PY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT[$ALL]"
else
  run "$PY" -m pip install -q --no-deps --no-build-isolation "$ROOT[$ALL]"
fi
run "$PY" -m pip check
