#!/usr/bin/env bash
# Start the PS shards of one host, each under its agent (which restarts a crashed shard).
#
#   scripts/launch_ps.sh --config JOB --controller HOST:PORT --run-dir DIR --shards 0,1 \
#                        [--host ADDR] [--port-base 5000] [--metrics-port-base 9300] \
#                        [--restore CKPT] [--wait SECONDS]
#   scripts/launch_ps.sh --stop --run-dir DIR [--shards 0,1]
# Metrics ports default to 9300 + K (9100 is node_exporter's).
#
# Shard K listens on ADDR:(port-base + K) -- a fixed port, so a restarted shard comes back
# where the workers expect it -- and serves Prometheus /metrics on metrics-port-base + K.
# --host ADDR binds this host's shards to ADDR: the script writes DIR/job-ps-ADDR.toml, the
# job with [ps] host = ADDR (default: [ps] host of the job, e.g. "0.0.0.0").
# Logs: DIR/logs/ps-K.log; ready files (port, metrics_port, pid): DIR/ps/ps-K.ready;
# agent pids: DIR/pids/ps-K.pid (each agent leads its own process group).
# --wait S: wait up to S seconds for every ready file, then print the shard addresses
# ("PS=host:port,..." last) -- pass them to launch_workers.sh --ps.
# --stop: SIGTERM each agent's process group (agents stop their shard cleanly), SIGKILL after 20 s.
# Every process gets METAPS_T0 (the job start time; set it to the same value on every host).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/_fleet_lib.sh"
fleet_python

CONFIG="" CONTROLLER="" RUN_DIR="" SHARDS="" HOST="" PORT_BASE=5000 METRICS_BASE=9300 RESTORE="" WAIT=0 STOP=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --config) CONFIG="$2"; shift 2 ;;
    --controller) CONTROLLER="$2"; shift 2 ;;
    --run-dir) RUN_DIR="$2"; shift 2 ;;
    --shards) SHARDS="$2"; shift 2 ;;
    --host) HOST="$2"; shift 2 ;;
    --port-base) PORT_BASE="$2"; shift 2 ;;
    --metrics-port-base) METRICS_BASE="$2"; shift 2 ;;
    --restore) RESTORE="$2"; shift 2 ;;
    --wait) WAIT="$2"; shift 2 ;;
    --stop) STOP=1; shift ;;
    -h|--help) usage 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done

[[ -n "$RUN_DIR" ]] || die "--run-dir is required"

if [[ "$STOP" == 1 ]]; then
  stop_role ps "$RUN_DIR" "$SHARDS"
  exit 0
fi

require_job_args "$CONFIG" "$CONTROLLER"
require_index_list --shards "shard index" "$SHARDS"
require_uint --port-base "$PORT_BASE"
require_uint --metrics-port-base "$METRICS_BASE"

mkdir -p "$RUN_DIR/logs" "$RUN_DIR/ps" "$RUN_DIR/pids"
export METAPS_T0="${METAPS_T0:-$(date +%s.%N)}" PYTHONUNBUFFERED=1
JOB="$CONFIG"
if [[ -n "$HOST" ]]; then
  JOB="$RUN_DIR/job-ps-$HOST.toml"
  "$PY" -m metaps config-write --config "$CONFIG" --set "ps.host=\"$HOST\"" --out "$JOB"
fi
ADVERTISE="${HOST:-$(hostname -I 2>/dev/null | awk '{print $1}')}"
ADVERTISE="${ADVERTISE:-127.0.0.1}"

ADDRS=()
declare -A ADDR_OF
for K in ${SHARDS//,/ }; do
  PORT=$((PORT_BASE + K)); MPORT=$((METRICS_BASE + K))
  READY="$RUN_DIR/ps/ps-$K.ready"
  rm -f "$READY"
  CHILD=("$PY" -m metaps ps --config "$JOB" --shard "$K" --port "$PORT" --metrics-port "$MPORT" --ready-file "$READY" \
         --checkpoint-root "$RUN_DIR/checkpoints")
  [[ -n "$RESTORE" ]] && CHILD+=(--restore "$RESTORE")
  start_agent "$RUN_DIR" "ps-$K" "$PY" -m metaps agent --config "$JOB" --role ps --index "$K" \
    --controller "$CONTROLLER" -- "${CHILD[@]}"
  ADDRS+=("$ADVERTISE:$PORT"); ADDR_OF[$K]="$ADVERTISE:$PORT"
done

if [[ "$WAIT" != 0 ]]; then
  for K in ${SHARDS//,/ }; do
    wait_ready "$RUN_DIR/ps/ps-$K.ready" "$WAIT" "$RUN_DIR/pids/ps-$K.pid" "$RUN_DIR/logs/ps-$K.log" \
      || { echo "launch_ps.sh: shard $K not ready" >&2; exit 1; }
    echo "ps-$K ${ADDR_OF[$K]} ready"
  done
fi
(IFS=,; echo "PS=${ADDRS[*]}")
