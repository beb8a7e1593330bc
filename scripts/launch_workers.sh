#!/usr/bin/env bash
# Start the workers of one host, each under its agent (which restarts a crashed worker).
#
#   scripts/launch_workers.sh --config JOB --controller HOST:PORT --ps ADDR,ADDR... --run-dir DIR \
#                             --ranks 0,1 [--metrics-port-base 9200] [--wait]
#   scripts/launch_workers.sh --stop --run-dir DIR [--ranks 0,1]
#
# Worker R trains on the shards the controller leases it, pulls/pushes rows at the PS
# addresses (shard order, as printed by launch_ps.sh), serves Prometheus /metrics on
# metrics-port-base + R and writes DIR/workers/worker-R.json at the end (rank 0 also the
# final checkpoint under DIR/checkpoints and the merged eval). DIR must be shared by the
# hosts (NFS or the like) for rank 0's eval merge and the coordinated checkpoints.
# Logs: DIR/logs/worker-R.log; agent pids: DIR/pids/worker-R.pid (each its own process group).
# --wait: wait for this host's agents; exit 1 if any failed (its restart limit reached).
#   SIGINT/SIGTERM while waiting stop this host's workers.
# --stop: SIGTERM each agent (it stops its worker), SIGKILL its group after 20 s.
# Every process gets METAPS_T0 (the job start time; set it to the same value on every host).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/_fleet_lib.sh"
fleet_python

CONFIG="" CONTROLLER="" PS="" RUN_DIR="" RANKS="" METRICS_BASE=9200 WAIT=0 STOP=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --config) CONFIG="$2"; shift 2 ;;
    --controller) CONTROLLER="$2"; shift 2 ;;
    --ps) PS="$2"; shift 2 ;;
    --run-dir) RUN_DIR="$2"; shift 2 ;;
    --ranks) RANKS="$2"; shift 2 ;;
    --metrics-port-base) METRICS_BASE="$2"; shift 2 ;;
    --wait) WAIT=1; shift ;;
    --stop) STOP=1; shift ;;
    -h|--help) usage 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done

[[ -n "$RUN_DIR" ]] || die "--run-dir is required"

if [[ "$STOP" == 1 ]]; then
  stop_role worker "$RUN_DIR" "$RANKS"
  exit 0
fi

require_job_args "$CONFIG" "$CONTROLLER"
[[ -n "$PS" ]] || die "--ps HOST:PORT,... is required (launch_ps.sh prints it)"
require_index_list --ranks "worker rank" "$RANKS"
require_uint --metrics-port-base "$METRICS_BASE"

mkdir -p "$RUN_DIR/logs" "$RUN_DIR/workers" "$RUN_DIR/pids"
export METAPS_T0="${METAPS_T0:-$(date +%s.%N)}" PYTHONUNBUFFERED=1

PIDS=()
for R in ${RANKS//,/ }; do
  start_agent "$RUN_DIR" "worker-$R" "$PY" -m metaps agent --config "$CONFIG" --role worker --index "$R" \
    --controller "$CONTROLLER" -- "$PY" -m metaps worker --config "$CONFIG" --rank "$R" --ps "$PS" \
    --controller "$CONTROLLER" --run-dir "$RUN_DIR" --metrics-port "$((METRICS_BASE + R))"
  PIDS+=("$(cat "$RUN_DIR/pids/worker-$R.pid")")
done

if [[ "$WAIT" == 1 ]]; then
  trap 'echo "launch_workers.sh: stopping workers" >&2; stop_role worker "$RUN_DIR" "$RANKS"; exit 130' INT TERM
  FAILED=0
  for P in "${PIDS[@]}"; do
    RC=0; wait "$P" || RC=$?
    if [[ "$RC" != 0 ]]; then echo "launch_workers.sh: agent $P exited with code $RC" >&2; FAILED=1; fi
  done
  for R in ${RANKS//,/ }; do rm -f "$RUN_DIR/pids/worker-$R.pid"; done
  exit "$FAILED"
fi
