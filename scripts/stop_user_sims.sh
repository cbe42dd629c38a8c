#!/usr/bin/env bash
# Stop the user-simulator instances recorded by scripts/start_user_sims.sh, and nothing else.
#
#   scripts/stop_user_sims.sh [--run-dir DIR] [--ports P1,P2,...] [--grace SECONDS]
#
# Env: RUN_DIR (outputs/run), PORTS (default: every RUN_DIR/user_sim_*.pid), STOP_GRACE (20 s).
# For each PID file ("PID START_TICKS" of port P) the process is signalled only when it is verifiably ours: alive
# with that start time (not a reused PID), owned by this user, and its command line is a simulator server with
# --port P. Then SIGTERM, a wait of up to the grace period, and SIGKILL for the instance and its own descendants
# (found through /proc, each checked by owner and start time; no process group is ever signalled). The PID file is
# removed (and RUN_DIR/user_sim_urls.txt once no PID file is left). Holds RUN_DIR/user_sims.lock like the start
# script. Never looks processes up by name.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/user_sim_proc.sh
source "$REPO_ROOT/scripts/user_sim_proc.sh"
RUN_DIR="${RUN_DIR:-outputs/run}"
PORTS="${PORTS:-}"
GRACE="${STOP_GRACE:-20}"
VOUCHED=" ${USER_SIMS_VOUCHED:-} "   # "PID:TICKS" started by the calling start script (set by it only)

die() { echo "stop_user_sims: $*" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --run-dir) [[ $# -ge 2 ]] || die "--run-dir needs a value"; RUN_DIR="$2"; shift 2 ;;
    --ports) [[ $# -ge 2 ]] || die "--ports needs a value"; PORTS="$2"; shift 2 ;;
    --grace) [[ $# -ge 2 ]] || die "--grace needs a value"; GRACE="$2"; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done
[[ "$GRACE" =~ ^[0-9]+$ ]] || die "--grace must be whole seconds, got '$GRACE'"
[[ "$RUN_DIR" = /* ]] || RUN_DIR="$PWD/$RUN_DIR"
cd "$REPO_ROOT"
if [[ -d "$RUN_DIR" && "${USER_SIMS_LOCK_HELD:-}" != "$RUN_DIR" ]]; then
  exec 9>>"$RUN_DIR/user_sims.lock"
  flock -w 60 9 || die "another start/stop holds $RUN_DIR/user_sims.lock"
fi

PID_FILES=()
if [[ -n "$PORTS" ]]; then
  IFS=',' read -r -a port_list <<< "$PORTS"
  for port in "${port_list[@]}"; do PID_FILES+=("$RUN_DIR/user_sim_${port}.pid"); done
else
  shopt -s nullglob
  PID_FILES=("$RUN_DIR"/user_sim_*.pid)
fi

# True when the record (PID, TICKS) of PORT is an instance we may signal (see the header).
is_ours() {
  local pid="$1" ticks="$2" port="$3"
  if [[ "$VOUCHED" == *" $pid:$ticks "* ]]; then
    proc_is_alive_since "$pid" "$ticks" && proc_is_mine "$pid"
  else
    proc_is_our_sim "$pid" "$ticks" "$port"
  fi
}

status=0
for pid_file in "${PID_FILES[@]}"; do
  if [[ ! -f "$pid_file" ]]; then
    echo "stop_user_sims: no PID file $pid_file" >&2
    continue
  fi
  port="$(basename "$pid_file" .pid)"; port="${port#user_sim_}"
  pid="" ticks=""
  read -r pid ticks < "$pid_file" || true
  if [[ ! "${pid:-}" =~ ^[0-9]+$ ]]; then
    echo "stop_user_sims: $pid_file does not hold a PID; removing it" >&2
    rm -f "$pid_file"; continue
  fi
  if ! is_ours "$pid" "${ticks:-}" "$port"; then
    echo "stop_user_sims: PID $pid from $pid_file is not running, was reused, has no start time to verify, is not" \
         "yours or is not a simulator on port $port; not signalling it; removing the file" >&2
    rm -f "$pid_file"; continue
  fi
  mapfile -t leftovers < <(proc_descendants "$pid")   # before TERM: an exiting parent orphans its children
  kill -TERM "$pid" 2>/dev/null || true
  for (( waited = 0; waited < GRACE * 10; waited++ )); do
    proc_is_alive_since "$pid" "$ticks" || break
    sleep 0.1
  done
  if proc_is_alive_since "$pid" "$ticks"; then
    kill -KILL "$pid" 2>/dev/null || true
    echo "stop_user_sims: PID $pid did not exit within ${GRACE}s after TERM; sent KILL" >&2
  fi
  for record in "${leftovers[@]}"; do   # the instance's own descendants (e.g. vLLM engine workers), one by one
    read -r child child_ticks <<< "$record"
    if proc_is_alive_since "$child" "$child_ticks" && proc_is_mine "$child"; then
      kill -KILL "$child" 2>/dev/null || true
      echo "stop_user_sims: killed PID $child left behind by PID $pid" >&2
    fi
  done
  for (( waited = 0; waited < 50; waited++ )); do proc_is_alive_since "$pid" "$ticks" || break; sleep 0.1; done
  if proc_is_alive_since "$pid" "$ticks"; then
    echo "stop_user_sims: PID $pid still alive after KILL" >&2; status=1; continue
  fi
  rm -f "$pid_file"
  echo "stop_user_sims: stopped PID $pid ($pid_file)" >&2
done
shopt -s nullglob
remaining=("$RUN_DIR"/user_sim_*.pid)
if (( ${#remaining[@]} == 0 )); then rm -f "$RUN_DIR/user_sim_urls.txt"; fi
exit "$status"
