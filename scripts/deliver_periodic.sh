#!/usr/bin/env bash
# Periodic model delivery: turn a training run's newest checkpoint into a served bundle.
#
# Usage:
#   scripts/deliver_periodic.sh RUN_DIR OUT_DIR [INTERVAL] [extra `metaps deliver` flags...]
#
#   RUN_DIR   the training run (RUN_DIR/checkpoints/ckpt-<step>/)
#   OUT_DIR   the publish root (OUT_DIR/v000001/..., OUT_DIR/LATEST)
#   INTERVAL  loop interval, e.g. 10m (default); "once" runs a single delivery (for cron)
#
# Either run the loop under a supervisor:
#   scripts/deliver_periodic.sh runs/main /srv/bundles 10m --incremental --keep 5 \
#       --holdout data/holdout.parquet --max-auc-drop 0.005
# or a one-shot from cron (every 10 minutes; LATEST only moves when the gate passes):
#   */10 * * * * cd /opt/metaps && scripts/deliver_periodic.sh runs/main /srv/bundles once --incremental >> /var/log/metaps-deliver.log 2>&1
#
# Exit codes (one-shot): 0 published or nothing newer, 1 bad input, 3 refused by the gate.
set -euo pipefail

if [[ $# -lt 2 ]]; then
  sed -n '2,20p' "$0" >&2
  exit 2
fi
RUN_DIR=$1
OUT_DIR=$2
INTERVAL=${3:-10m}
shift $(( $# >= 3 ? 3 : 2 ))

METAPS=${METAPS:-metaps}
if [[ "$INTERVAL" == "once" ]]; then
  exec "$METAPS" deliver --run "$RUN_DIR" --out "$OUT_DIR" "$@"
fi
exec "$METAPS" deliver --run "$RUN_DIR" --out "$OUT_DIR" --every "$INTERVAL" "$@"
