# Helpers shared by launch_ps.sh and launch_workers.sh (sourced, not run).
#
# fleet_python                      set PY: $METAPS_PYTHON, else ROOT/.venv/bin/python, else python3
# usage [RC]                        print the calling script's header comment; exit RC (2)
# die MESSAGE                       "SCRIPT: error: MESSAGE" on stderr; exit 2
# require_job_args CONFIG CONTROLLER   --config given and a file, --controller given
# require_uint OPTION VALUE         VALUE is a non-negative integer, else die naming OPTION
# require_index_list OPTION WHAT LIST  LIST is "K,K,..." of non-negative integers (checked before
#                                   anything starts), else die naming OPTION and the bad entry
# start_agent RUN_DIR NAME CMD...   run CMD in its own session (process group = its pid),
#                                   output to RUN_DIR/logs/NAME.log, pid to RUN_DIR/pids/NAME.pid
# wait_ready FILE TIMEOUT PIDFILE LOG   wait for FILE; fail early if the agent died
# stop_role ROLE RUN_DIR [INDICES]  SIGTERM each ROLE-K agent, then SIGKILL its group after it exits
#                                   or STOP_GRACE_S (20) pass

start_agent() {
  local run_dir="$1" name="$2"; shift 2
  # Non-interactive bash puts background jobs in the script's group, so setsid does not
  # fork: the recorded pid is the agent's and also its process group id.
  setsid "$@" >>"$run_dir/logs/$name.log" 2>&1 </dev/null &
  echo $! >"$run_dir/pids/$name.pid"
  echo "started $name pid $! (log $run_dir/logs/$name.log)" >&2
}

wait_ready() {
  local file="$1" timeout="$2" pidfile="$3" logf="$4" t=0
  while [[ ! -f "$file" ]]; do
    if ! kill -0 "$(cat "$pidfile")" 2>/dev/null; then
      echo "agent $(cat "$pidfile") exited before $file appeared; log tail:" >&2
      tail -n 20 "$logf" >&2
      return 1
    fi
    if (( t >= timeout * 10 )); then
      echo "timed out after ${timeout}s waiting for $file" >&2
      return 1
    fi
    sleep 0.1; t=$((t + 1))
  done
}

group_alive() {  # is any non-zombie process in process group $1?
  local g="$1" s line rest
  for s in /proc/[0-9]*/stat; do
    { read -r line <"$s"; } 2>/dev/null || continue
    rest="${line##*) }"
    set -- $rest
    [[ "$1" != Z && "$3" == "$g" ]] && return 0
  done
  return 1
}

stop_role() {
  local role="$1" run_dir="$2" indices="${3:-}" grace="${STOP_GRACE_S:-20}" files=() f pid t
  if [[ -n "$indices" ]]; then
    for k in ${indices//,/ }; do files+=("$run_dir/pids/$role-$k.pid"); done
  else
    shopt -s nullglob; files=("$run_dir/pids/$role"-*.pid); shopt -u nullglob
  fi
  for f in "${files[@]}"; do
    [[ -f "$f" ]] || continue
    pid="$(cat "$f")"
    kill -TERM "$pid" 2>/dev/null || true   # the agent stops its child cleanly
  done
  for f in "${files[@]}"; do
    [[ -f "$f" ]] || continue
    pid="$(cat "$f")"; t=0
    while group_alive "$pid" && (( t < grace * 10 )); do sleep 0.1; t=$((t + 1)); done
    kill -KILL -- "-$pid" 2>/dev/null || true
    rm -f "$f"
    echo "stopped $(basename "$f" .pid)" >&2
  done
}

fleet_python() {
  PY="${METAPS_PYTHON:-}"
  if [[ -z "$PY" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY="python3"; fi
  fi
}

usage() {  # the header comment of the script that sourced this file, up to its first code line
  awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
  exit "${1:-2}"
}

die() { echo "$(basename "$0"): error: $*" >&2; exit 2; }

require_job_args() {
  local config="$1" controller="$2"
  [[ -n "$config" ]] || die "--config is required"
  [[ -f "$config" ]] || die "--config $config: no such file"
  [[ -n "$controller" ]] || die "--controller HOST:PORT is required"
}

require_uint() {
  [[ "$2" =~ ^[0-9]+$ ]] || die "$1 must be a non-negative integer, got '$2'"
}

require_index_list() {
  local option="$1" what="$2" list="$3" k
  [[ -n "$list" ]] || die "$option is required (e.g. 0,1)"
  for k in ${list//,/ }; do
    [[ "$k" =~ ^[0-9]+$ ]] || die "$option: '$k' is not a $what"
  done
}
