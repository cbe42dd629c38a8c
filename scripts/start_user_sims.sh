#!/usr/bin/env bash
# Start N user-simulator instances on loopback, wait until each answers GET /health, and record their PIDs.
#
#   scripts/start_user_sims.sh [--num-instances N] [--base-port P | --ports P1,P2,...] [--gpus 0,1,2,3] [--tp TP]
#                              [--model DIR] [--backend vllm|hf|scripted] [--scenario YAML] [--run-dir DIR]
#                              [--served-model-name NAME] [--api-key-file FILE] [--timeout SECONDS] [--seed N]
#                              [--max-model-len TOKENS] [--gpu-memory-utilization FRACTION] [-- EXTRA SERVER ARGS]
#
# Every option also reads an environment variable: NUM_INSTANCES (1), BASE_PORT (5000), PORTS, GPUS, TP (1),
# MODEL, USER_SIM_BACKEND (vllm with a MODEL, scripted without), SCENARIO, RUN_DIR (outputs/run),
# SERVED_MODEL_NAME (user-sim), API_KEY_FILE, HEALTH_TIMEOUT (600 s for vllm, 120 s otherwise), SEED (0; the same
# for every instance, so any instance answers a given request identically and a retry elsewhere is consistent),
# VLLM_PYTHON (.venv-vllm/bin/python), PYTHON (.venv/bin/python, else python3), MAX_MODEL_LEN (8192: the
# simulator's persona prompt plus a 15-turn call, well under a 14B model's 32k) and GPU_MEMORY_UTILIZATION (0.9;
# the instance owns its GPUs) for vllm.
#
# Backends: vllm = vLLM's own OpenAI server (python -m vllm.entrypoints.openai.api_server), instance i on GPUs
# GPUS[i*TP .. i*TP+TP-1] via CUDA_VISIBLE_DEVICES with --tensor-parallel-size TP, --max-model-len,
# --gpu-memory-utilization and --seed, in an environment without the trainer's TORCHDYNAMO_DISABLE and
# OMP_NUM_THREADS (vLLM needs torch.compile for its CUDA graphs); a model that cannot fit makes the instance exit
# and the start fail with its log tail; hf = our server's
# transformers backend; scripted = our server's scripted persona (no model, CPU).
# API key: the environment variable SEAD_USER_SIM_API_KEY, or --api-key-file FILE (mode 0600, yours); it reaches
# the servers through their environment (vLLM: VLLM_API_KEY), never a command line, and is never logged.
# Each instance runs in its own session (setsid). For port P it writes RUN_DIR/user_sim_P.pid ("PID START_TICKS",
# START_TICKS from /proc/PID/stat guards against PID reuse) and RUN_DIR/user_sim_P.log; RUN_DIR/user_sim_urls.txt
# gets the comma-separated base URLs, also printed last. Every file it writes is readable by its owner only.
# One start or stop at a time per RUN_DIR (a lock on RUN_DIR/user_sims.lock; a second call fails at once), and a
# start succeeds only when the process it started is alive and is the one listening on its port.
# On failure (an instance exits, the deadline passes, or the script gets SIGINT/SIGTERM/SIGHUP) the log tail is
# shown, the instances this call started are stopped via scripts/stop_user_sims.sh, and the exit status is 1.
set -euo pipefail
umask 077   # PID files, logs and the URL list: owner only

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/user_sim_proc.sh
source "$REPO_ROOT/scripts/user_sim_proc.sh"
NUM_INSTANCES="${NUM_INSTANCES:-1}"
BASE_PORT="${BASE_PORT:-5000}"
PORTS="${PORTS:-}"
GPUS="${GPUS:-}"
TP="${TP:-1}"
MODEL="${MODEL:-}"
BACKEND="${USER_SIM_BACKEND:-}"
SCENARIO="${SCENARIO:-}"
RUN_DIR="${RUN_DIR:-outputs/run}"
SERVED_MODEL_NAME="${SERVED_MODEL_NAME:-user-sim}"
API_KEY_FILE="${API_KEY_FILE:-}"
HEALTH_TIMEOUT="${HEALTH_TIMEOUT:-}"
SEED="${SEED:-0}"
MAX_MODEL_LEN="${MAX_MODEL_LEN:-8192}"
GPU_MEMORY_UTILIZATION="${GPU_MEMORY_UTILIZATION:-0.9}"
EXTRA_ARGS=()

die() { echo "start_user_sims: $*" >&2; exit 2; }
need_value() { [[ $# -ge 2 && -n "$2" ]] || die "option $1 needs a value"; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --num-instances) need_value "$@"; NUM_INSTANCES="$2"; shift 2 ;;
    --base-port) need_value "$@"; BASE_PORT="$2"; shift 2 ;;
    --ports) need_value "$@"; PORTS="$2"; shift 2 ;;
    --gpus) need_value "$@"; GPUS="$2"; shift 2 ;;
    --tp) need_value "$@"; TP="$2"; shift 2 ;;
    --model) need_value "$@"; MODEL="$2"; shift 2 ;;
    --backend) need_value "$@"; BACKEND="$2"; shift 2 ;;
    --scenario) need_value "$@"; SCENARIO="$2"; shift 2 ;;
    --run-dir) need_value "$@"; RUN_DIR="$2"; shift 2 ;;
    --served-model-name) need_value "$@"; SERVED_MODEL_NAME="$2"; shift 2 ;;
    --api-key) die "--api-key is not accepted (a command line is visible to every local user); set SEAD_USER_SIM_API_KEY or pass --api-key-file FILE (mode 0600)" ;;
    --api-key-file) need_value "$@"; API_KEY_FILE="$2"; shift 2 ;;
    --timeout) need_value "$@"; HEALTH_TIMEOUT="$2"; shift 2 ;;
    --seed) need_value "$@"; SEED="$2"; shift 2 ;;
    --max-model-len) need_value "$@"; MAX_MODEL_LEN="$2"; shift 2 ;;
    --gpu-memory-utilization) need_value "$@"; GPU_MEMORY_UTILIZATION="$2"; shift 2 ;;
    --) shift; EXTRA_ARGS=("$@"); break ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done

is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }
if [[ -z "$BACKEND" ]]; then
  if [[ -n "$MODEL" ]]; then BACKEND=vllm; else BACKEND=scripted; fi
fi
case "$BACKEND" in
  vllm|hf) [[ -n "$MODEL" ]] || die "--backend $BACKEND needs --model (or MODEL=...)" ;;
  scripted) ;;
  *) die "--backend must be vllm, hf or scripted, got '$BACKEND'" ;;
esac
is_uint "$TP" && (( TP >= 1 )) || die "--tp must be a positive integer, got '$TP'"
if [[ -n "$PORTS" ]]; then
  IFS=',' read -r -a PORT_LIST <<< "$PORTS"
else
  is_uint "$NUM_INSTANCES" && (( NUM_INSTANCES >= 1 )) || die "--num-instances must be >= 1, got '$NUM_INSTANCES'"
  is_uint "$BASE_PORT" || die "--base-port must be a port number, got '$BASE_PORT'"
  PORT_LIST=()
  for (( i = 0; i < NUM_INSTANCES; i++ )); do PORT_LIST+=("$(( BASE_PORT + i ))"); done
fi
for port in "${PORT_LIST[@]}"; do
  is_uint "$port" && (( port >= 1 && port <= 65535 )) || die "invalid port '$port'"
done
GPU_LIST=()
if [[ -n "$GPUS" ]]; then IFS=',' read -r -a GPU_LIST <<< "$GPUS"; fi
if [[ "$BACKEND" == vllm && ${#GPU_LIST[@]} -gt 0 ]] && (( ${#GPU_LIST[@]} < ${#PORT_LIST[@]} * TP )); then
  die "${#PORT_LIST[@]} instance(s) x TP $TP need $(( ${#PORT_LIST[@]} * TP )) GPUs, --gpus lists ${#GPU_LIST[@]}"
fi
if [[ -z "$HEALTH_TIMEOUT" ]]; then
  if [[ "$BACKEND" == vllm ]]; then HEALTH_TIMEOUT=600; else HEALTH_TIMEOUT=120; fi
fi
[[ "$SEED" =~ ^-?[0-9]+$ ]] || die "--seed must be an integer, got '$SEED'"
is_uint "$HEALTH_TIMEOUT" || die "--timeout must be whole seconds, got '$HEALTH_TIMEOUT'"
SIM_API_KEY="${SEAD_USER_SIM_API_KEY:-}"
if [[ -n "$API_KEY_FILE" ]]; then
  [[ -f "$API_KEY_FILE" && -r "$API_KEY_FILE" ]] || die "--api-key-file $API_KEY_FILE is not a readable file"
  [[ "$(stat -c %u "$API_KEY_FILE")" == "$(id -u)" ]] || die "--api-key-file $API_KEY_FILE is not owned by you"
  (( (8#$(stat -c %a "$API_KEY_FILE") & 8#077) == 0 )) || die "--api-key-file $API_KEY_FILE may be read by others: chmod 600 $API_KEY_FILE"
  SIM_API_KEY="$(tr -d '[:space:]' < "$API_KEY_FILE")"
  [[ -n "$SIM_API_KEY" ]] || die "--api-key-file $API_KEY_FILE is empty"
fi
unset SEAD_USER_SIM_API_KEY

# Paths given relative to the caller's directory stay valid after the cd to the repository root.
absolute() { if [[ "$1" = /* ]]; then echo "$1"; else echo "$PWD/$1"; fi; }
RUN_DIR="$(absolute "$RUN_DIR")"
[[ -n "$SCENARIO" ]] && SCENARIO="$(absolute "$SCENARIO")"
[[ -n "$MODEL" && -e "$MODEL" ]] && MODEL="$(absolute "$MODEL")"   # else a hub id, passed through
PYTHON="${PYTHON:-}"
[[ "$PYTHON" == */* ]] && PYTHON="$(absolute "$PYTHON")"
VLLM_PYTHON="${VLLM_PYTHON:-$REPO_ROOT/.venv-vllm/bin/python}"
[[ "$VLLM_PYTHON" == */* ]] && VLLM_PYTHON="$(absolute "$VLLM_PYTHON")"
cd "$REPO_ROOT"
if [[ -z "$PYTHON" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON="$REPO_ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
mkdir -p "$RUN_DIR"
# One start/stop at a time per run directory; fd 9 is closed in the instances so they never inherit the lock.
exec 9>>"$RUN_DIR/user_sims.lock"
flock -n 9 || { echo "start_user_sims: another start/stop is running on $RUN_DIR (lock $RUN_DIR/user_sims.lock)" >&2; exit 1; }
export USER_SIMS_LOCK_HELD="$RUN_DIR"   # the stop script run by fail() below must not wait for our own lock

STARTED_PORTS=()
STARTED_RECORDS=()   # "PID:TICKS" of the instances this call started
fail() {
  echo "start_user_sims: $1" >&2
  if [[ -n "${2:-}" && -f "$2" ]]; then echo "---- last 40 lines of $2 ----" >&2; tail -n 40 "$2" >&2; fi
  local p f child child_ticks
  for p in "${PORT_LIST[@]}"; do   # a signal between a PID file's write and the bookkeeping below: still ours
    f="$RUN_DIR/user_sim_${p}.pid"
    [[ " ${STARTED_PORTS[*]} " == *" $p "* || ! -f "$f" ]] && continue
    read -r child child_ticks < "$f" || continue
    if [[ "$(proc_stat_field "$child" 4)" == "$$" ]]; then STARTED_PORTS+=("$p"); STARTED_RECORDS+=("$child:$child_ticks"); fi
  done
  if (( ${#STARTED_PORTS[@]} > 0 )); then
    # The instances this call started are ours even before their exec shows the server's command line.
    RUN_DIR="$RUN_DIR" USER_SIMS_VOUCHED="${STARTED_RECORDS[*]}" bash "$REPO_ROOT/scripts/stop_user_sims.sh" \
      --ports "$(IFS=,; echo "${STARTED_PORTS[*]}")" >&2 || true
  fi
  exit 1
}
# Interrupted while starting or waiting: stop what this call started, so no instance is orphaned.
on_signal() { fail "interrupted; stopping the instances this call started"; }
trap on_signal INT TERM HUP

for idx in "${!PORT_LIST[@]}"; do
  port="${PORT_LIST[$idx]}"
  pid_file="$RUN_DIR/user_sim_${port}.pid"
  log_file="$RUN_DIR/user_sim_${port}.log"
  if [[ -f "$pid_file" ]]; then
    old_pid="" old_ticks=""
    read -r old_pid old_ticks < "$pid_file" || true
    if proc_is_our_sim "${old_pid:-}" "${old_ticks:-}" "$port"; then
      fail "port $port already has a running instance (PID $old_pid in $pid_file); stop it first"
    fi
    rm -f "$pid_file"   # stale: that process is gone (or its PID now belongs to someone else)
  fi
  if curl -s -o /dev/null --max-time 2 "http://127.0.0.1:${port}/health"; then
    fail "port $port is already answering HTTP (not started by us); choose another port"
  fi
  env_prefix=()
  case "$BACKEND" in
    vllm)
      [[ -x "$VLLM_PYTHON" ]] || fail "VLLM_PYTHON=$VLLM_PYTHON is not an executable python (install requirements_vllm.txt)"
      cmd=("$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name "$SERVED_MODEL_NAME"
           --host 127.0.0.1 --port "$port" --tensor-parallel-size "$TP" --max-model-len "$MAX_MODEL_LEN"
           --gpu-memory-utilization "$GPU_MEMORY_UTILIZATION" --seed "$SEED")
      env_prefix=(env -u TORCHDYNAMO_DISABLE -u OMP_NUM_THREADS)  # the trainer's settings are not the server's
      if (( ${#GPU_LIST[@]} > 0 )); then
        devices="$(IFS=,; echo "${GPU_LIST[*]:$(( idx * TP )):$TP}")"
        env_prefix+=("CUDA_VISIBLE_DEVICES=$devices")
      fi ;;
    hf|scripted)
      cmd=("$PYTHON" -m llm_agent.user_sim.server --backend "$BACKEND" --host 127.0.0.1 --port "$port"
           --served-model-name "$SERVED_MODEL_NAME" --seed "$SEED")
      [[ "$BACKEND" == hf ]] && cmd+=(--model "$MODEL")
      [[ -n "$SCENARIO" ]] && cmd+=(--scenario "$SCENARIO")
      if (( ${#GPU_LIST[@]} > 0 )); then env_prefix=(env "CUDA_VISIBLE_DEVICES=${GPU_LIST[$(( idx % ${#GPU_LIST[@]} ))]}"); fi ;;
  esac
  cmd+=("${EXTRA_ARGS[@]}")
  rm -f "$log_file"
  echo "start_user_sims: port $port: ${cmd[*]}" > "$log_file"
  (
    if [[ -n "$SIM_API_KEY" ]]; then export SEAD_USER_SIM_API_KEY="$SIM_API_KEY" VLLM_API_KEY="$SIM_API_KEY"; fi
    exec setsid "${env_prefix[@]}" "${cmd[@]}"
  ) >> "$log_file" 2>&1 < /dev/null 9>&- &
  pid=$!
  ticks="$(proc_start_ticks "$pid")"
  [[ "$ticks" != 0 ]] || fail "instance on port $port (PID $pid) exited at once" "$log_file"
  echo "$pid $ticks" > "$pid_file"
  STARTED_PORTS+=("$port")
  STARTED_RECORDS+=("$pid:$ticks")
  echo "start_user_sims: started $BACKEND instance on port $port (PID $pid, log $log_file)" >&2
done

deadline=$(( SECONDS + HEALTH_TIMEOUT ))
URLS=()
for port in "${PORT_LIST[@]}"; do
  pid_file="$RUN_DIR/user_sim_${port}.pid"
  log_file="$RUN_DIR/user_sim_${port}.log"
  read -r pid ticks < "$pid_file"
  # Healthy means: our process is alive, answers /health, and holds the listening socket (so the answer did not
  # come from some other process on that port while ours died with "address in use"). The checks run in a child
  # bash: a signal arriving while this script parses a command substitution can trip bash's parser.
  while :; do
    ready=0
    bash "$REPO_ROOT/scripts/user_sim_proc.sh" proc_instance_ready "$pid" "$ticks" "$port" || ready=$?
    (( ready == 0 )) && break
    (( ready != 3 )) || fail "instance on port $port (PID $pid) exited before becoming healthy" "$log_file"
    (( SECONDS < deadline )) || fail "instance on port $port not healthy within ${HEALTH_TIMEOUT}s" "$log_file"
    sleep 1
  done
  URLS+=("http://127.0.0.1:${port}")
done
trap - INT TERM HUP
(IFS=,; echo "${URLS[*]}") > "$RUN_DIR/user_sim_urls.txt"
echo "start_user_sims: ${#URLS[@]} instance(s) healthy" >&2
(IFS=,; echo "${URLS[*]}")
