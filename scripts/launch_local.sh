#!/usr/bin/env bash
# The whole fleet on this machine: a thin wrapper of `metaps launch`.
#
#   scripts/launch_local.sh [--config configs/local.toml] [metaps launch options...]
#
# e.g. scripts/launch_local.sh --workers 2 --ps 1 --no-progress
#      scripts/launch_local.sh --config configs/main_job.toml --resume-from runs/main/runs/latest
# Options are those of `metaps launch --help`; the exit code is the launcher's (0 ok,
# 1 training failed, 130/143 interrupted). Set METAPS_PYTHON to pick the interpreter.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${METAPS_PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY="python3"; fi
fi
HAS_CONFIG=0
for a in "$@"; do [[ "$a" == "--config" ]] && HAS_CONFIG=1; done
if [[ "$HAS_CONFIG" == 0 ]]; then set -- --config "$ROOT/configs/local.toml" "$@"; fi
exec "$PY" -m metaps launch "$@"
