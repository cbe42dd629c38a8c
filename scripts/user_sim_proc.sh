# Sourced by start_user_sims.sh and stop_user_sims.sh: reading /proc safely and deciding whether a PID is one of
# our simulator instances. Never looks processes up by name and never signals a process group.

# Field N (1-based, N >= 3) of /proc/PID/stat, or "" when PID is gone. Field 2 (comm, in parentheses) may hold
# spaces and ')' itself, so the line is split after its LAST ')': the fields after it start at field 3 (state).
proc_stat_field() {
  local stat="" rest fields index
  { IFS= read -r -d '' stat < "/proc/$1/stat"; } 2>/dev/null || true   # whole file, no fork; comm may hold \n
  [[ -n "$stat" ]] || { echo ""; return 0; }
  rest="${stat##*) }"
  read -r -a fields <<< "$rest"
  index=$(( $2 - 3 ))
  echo "${fields[index]:-}"
}

# The start time of PID in clock ticks since boot (field 22), or 0 when PID is gone.
proc_start_ticks() {
  local ticks
  ticks="$(proc_stat_field "$1" 22)"
  echo "${ticks:-0}"
}

# True when PID is alive (not a zombie) and started at TICKS (so it is the process that was recorded).
proc_is_alive_since() {
  local state
  [[ "$1" =~ ^[1-9][0-9]*$ && "$2" =~ ^[1-9][0-9]*$ ]] || return 1
  state="$(proc_stat_field "$1" 3)"
  [[ -n "$state" && "$state" != Z && "$(proc_start_ticks "$1")" == "$2" ]]
}

# True when PID runs as this user (its /proc entry is owned by our uid).
proc_is_mine() {
  [[ "$(stat -c %u "/proc/$1" 2>/dev/null)" == "$(id -u)" ]]
}

# True when PID's command line is a simulator server (ours or vLLM's OpenAI server) listening on PORT.
proc_is_user_sim_cmd() {
  local pid="$1" port="$2" args=() i
  mapfile -d '' -t args < "/proc/$pid/cmdline" 2>/dev/null || return 1
  local is_server=1 has_port=1
  for (( i = 0; i < ${#args[@]}; i++ )); do
    case "${args[$i]}" in
      llm_agent.user_sim.server|vllm.entrypoints.openai.api_server) is_server=0 ;;
      --port) [[ "${args[$(( i + 1 ))]:-}" == "$port" ]] && has_port=0 ;;
      --port=*) [[ "${args[$i]#--port=}" == "$port" ]] && has_port=0 ;;
    esac
  done
  (( is_server == 0 && has_port == 0 ))
}

# True when PID is the simulator instance a PID file recorded: alive (not a zombie), started at TICKS, owned by
# us, and its command line is a simulator server on PORT. Anything else is never signalled.
proc_is_our_sim() {
  proc_is_alive_since "$1" "$2" && proc_is_mine "$1" && proc_is_user_sim_cmd "$1" "$3"
}

# "PID TICKS" of every live descendant of PID owned by us (children first found, then theirs), one per line.
proc_descendants() {
  local root="$1" entry pid ppid frontier=("$1") next
  declare -A parent_of=()
  for entry in /proc/[0-9]*; do
    pid="${entry#/proc/}"
    ppid="$(proc_stat_field "$pid" 4)"
    [[ -n "$ppid" ]] && parent_of[$pid]="$ppid"
  done
  while (( ${#frontier[@]} > 0 )); do
    next=()
    for pid in "${!parent_of[@]}"; do
      for root in "${frontier[@]}"; do
        if [[ "${parent_of[$pid]}" == "$root" ]] && proc_is_mine "$pid"; then
          echo "$pid $(proc_start_ticks "$pid")"
          next+=("$pid")
        fi
      done
    done
    frontier=("${next[@]}")
  done
}

# True when PID holds the socket listening on 127.0.0.1/0.0.0.0/[::] PORT (so /health answers come from it).
proc_listens_on() {
  local pid="$1" port hex inodes=() fd link
  hex="$(printf '%04X' "$2")"
  mapfile -t inodes < <(awk -v p=":$hex" '$4 == "0A" && substr($2, length($2) - 4) == p {print $10}' \
                        /proc/net/tcp /proc/net/tcp6 2>/dev/null)
  (( ${#inodes[@]} > 0 )) || return 1
  for fd in /proc/"$pid"/fd/*; do
    link="$(readlink "$fd" 2>/dev/null)" || continue
    for inode in "${inodes[@]}"; do
      [[ "$link" == "socket:[$inode]" ]] && return 0
    done
  done
  return 1
}

# Exit status 0 when the instance (PID, TICKS) on PORT is ready (ours, answering /health, holding the port's
# socket), 3 when it is gone, 1 when not ready yet. Run as a child (`bash user_sim_proc.sh proc_instance_ready
# ...`) by the start script's wait loop, so a signal never lands while the script itself runs these checks.
proc_instance_ready() {
  proc_is_alive_since "$1" "$2" || return 3
  proc_is_our_sim "$1" "$2" "$3" && curl -sf -o /dev/null --max-time 5 "http://127.0.0.1:$3/health" \
    && proc_listens_on "$1" "$3"
}

if [[ "${BASH_SOURCE[0]}" == "$0" && $# -gt 0 ]]; then "$@"; fi
