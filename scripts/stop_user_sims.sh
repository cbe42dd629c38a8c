#!/usr/bin/env bash
# Stop the user-simulator instances recorded by scripts/start_user_sims.sh, and nothing else.
#
#   scripts/stop_user_sims.sh [--run-dir DIR] [--ports P1,P2,...] [--grace SECONDS]
#
# Env: RUN_DIR (outputs/run), PORTS (default: every RUN_DIR/user_sim_*.pid), STOP_GRACE (20 s).
# For each PID file ("PID START_TICKS"): if that PID still runs and its start time matches (so the PID was not
# reused by an unrelated process; a file without a start time is never trusted), send SIGTERM, wait up to the grace period, then SIGKILL the instance's own
# process group (the instance was started with setsid, so its group holds only it and its children, e.g. vLLM's
# engine workers). Then remove the PID file (and RUN_DIR/user_sim_urls.txt once no PID file is left). Never looks
# processes up by name.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RUN_DIR="${RUN_DIR:-outputs/run}"
PORTS="${PORTS:-}"
GRACE="${STOP_GRACE:-20}"

die() { echo "stop_user_sims: $*" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --run-dir) [[ $# -ge 2 ]] || die "--run-dir needs a value"; RUN_DIR="$2"; shift 2 ;;
    --ports) [[ $# -ge 2 ]] || die "--ports needs a value"; PORTS="$2"; shift 2 ;;
    --grace) [[ $# -ge 2 ]] || die "--grace needs a value"; GRACE="$2"; shift 2 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done
[[ "$GRACE" =~ ^[0-9]+$ ]] || die "--grace must be whole seconds, got '$GRACE'"
[[ "$RUN_DIR" = /* ]] || RUN_DIR="$PWD/$RUN_DIR"
cd "$REPO_ROOT"

PID_FILES=()
if [[ -n "$PORTS" ]]; then
  IFS=',' read -r -a port_list <<< "$PORTS"
  for port in "${port_list[@]}"; do PID_FILES+=("$RUN_DIR/user_sim_${port}.pid"); done
else
  shopt -s nullglob
  PID_FILES=("$RUN_DIR"/user_sim_*.pid)
fi

# True when PID is alive and is the process recorded: the same start time in /proc/PID/stat (field 22). A
# record without a start time cannot be verified and is never treated as ours (the PID may have been reused).
is_ours() {
  local pid="$1" ticks="$2" now
  [[ "$ticks" =~ ^[1-9][0-9]*$ ]] || return 1
  kill -0 "$pid" 2>/dev/null || return 1
  now="$(awk '{print $22}' "/proc/$pid/stat" 2>/dev/null || echo gone)"
  [[ "$now" == "$ticks" ]]
}

status=0
for pid_file in "${PID_FILES[@]}"; do
  if [[ ! -f "$pid_file" ]]; then
    echo "stop_user_sims: no PID file $pid_file" >&2
    continue
  fi
  read -r pid ticks < "$pid_file" || true
  ticks="${ticks:-0}"
  if [[ ! "${pid:-}" =~ ^[0-9]+$ ]]; then
    echo "stop_user_sims: $pid_file does not hold a PID; removing it" >&2
    rm -f "$pid_file"; continue
  fi
  if ! is_ours "$pid" "$ticks"; then
    echo "stop_user_sims: PID $pid from $pid_file is not running, was reused, or has no start time to verify;" \
         "not signalling it; removing the file" >&2
    rm -f "$pid_file"; continue
  fi
  pgid="$(ps -o pgid= -p "$pid" 2>/dev/null | tr -d ' ' || true)"
  kill -TERM "$pid" 2>/dev/null || true
  for (( waited = 0; waited < GRACE * 10; waited++ )); do
    is_ours "$pid" "$ticks" || break
    sleep 0.1
  done
  if [[ "$pgid" == "$pid" ]] && kill -0 -- "-$pid" 2>/dev/null; then
    # The instance's own process group (leader = the recorded PID): leftovers are its children.
    kill -KILL -- "-$pid" 2>/dev/null || true
    echo "stop_user_sims: PID $pid (group) did not exit after TERM within ${GRACE}s or left children; sent KILL" >&2
  elif is_ours "$pid" "$ticks"; then
    kill -KILL "$pid" 2>/dev/null || true
    echo "stop_user_sims: PID $pid did not exit within ${GRACE}s; sent KILL" >&2
  fi
  for (( waited = 0; waited < 50; waited++ )); do is_ours "$pid" "$ticks" || break; sleep 0.1; done
  if is_ours "$pid" "$ticks"; then
    echo "stop_user_sims: PID $pid still alive after KILL" >&2; status=1; continue
  fi
  rm -f "$pid_file"
  echo "stop_user_sims: stopped PID $pid ($pid_file)" >&2
done
shopt -s nullglob
remaining=("$RUN_DIR"/user_sim_*.pid)
if (( ${#remaining[@]} == 0 )); then rm -f "$RUN_DIR/user_sim_urls.txt"; fi
exit "$status"
