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
# VLLM_PYTHON (.venv-vllm/bin/python), PYTHON (scripts/python_env.sh: `python` when it has
# the project, else the checkout's .venv), MAX_MODEL_LEN (8192: the
# simulator's persona prompt plus a 15-turn call, well under a 14B model's 32k) and GPU_MEMORY_UTILIZATION (0.9;
# the instance owns its GPUs) for vllm.
#
# Backends: vllm = vLLM's own OpenAI server (python -m vllm.entrypoints.openai.api_server), instance i on GPUs
# GPUS[i*TP .. i*TP+TP-1] via CUDA_VISIBLE_DEVICES with --tensor-parallel-size TP, --max-model-len,
# --gpu-memory-utilization and --seed, in an environment without the trainer's TORCHDYNAMO_DISABLE and
# OMP_NUM_THREADS (vLLM needs torch.compile for its CUDA graphs); a model that cannot fit makes the instance exit
# and the start fail with its log tail; hf = our server's transformers backend; scripted = our server's scripted
# persona (no model, CPU).
# API key: the environment variable SEAD_USER_SIM_API_KEY, or --api-key-file FILE (mode 0600, yours); it reaches
# the servers through their environment (vLLM: VLLM_API_KEY), never a command line, and is never logged.
# Each instance runs in its own session. For port P it writes RUN_DIR/user_sim_P.pid ("PID START_TICKS",
# START_TICKS from /proc/PID/stat guards against PID reuse) and RUN_DIR/user_sim_P.log; RUN_DIR/user_sim_urls.txt
# gets the comma-separated base URLs, also printed last. Every file it writes is readable by its owner only.
# One start or stop at a time per RUN_DIR (a lock on RUN_DIR/user_sims.lock; a second call fails at once), and a
# start succeeds only when the process it started is alive and is the one listening on its port.
# On failure (an instance exits, the deadline passes, or the script gets SIGINT/SIGTERM/SIGHUP) the log tail is
# shown, the instances this call started are stopped, and the exit status is 1 (2 for a bad option).
# The work is done by llm_agent/user_sim/instances.py (python -m llm_agent.user_sim.instances start).
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CALLER_DIR="$PWD"
SEAD_CALLER_DIR="$PWD"
source "$REPO_ROOT/scripts/python_env.sh"
sead_find_python  # PYTHON unset: `python` when it has the project, else the checkout's .venv
cd "$REPO_ROOT"   # python -m finds llm_agent here, whichever python runs it; paths stay relative to the caller
exec "$PYTHON" -m llm_agent.user_sim.instances start --caller-dir "$CALLER_DIR" "$@"
