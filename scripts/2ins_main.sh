#!/usr/bin/env bash
# The SEAD main job with two user-simulator instances of one GPU each (ports 5000 and 5001 on GPUs 6 and 7 when
# USER_SIM_MODEL is set); the policy workers keep GPUs 0-5. Everything else is scripts/main.sh (same presets,
# environment, --dry-run and key=value arguments), except that on the GPU presets (gpu, gpu_lora: a MODEL_PATH)
# it passes rollout_loop.config.max_turns=12, as the SEAD paper's two-instance setup runs 12 agent turns per
# dialogue (a max_turns argument of yours comes later and wins). On CPU (no USER_SIM_MODEL) the simulators are the
# two scripted instances of scripts/main.sh. ITERATIONS=N trains in iterations exactly as scripts/main.sh does.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${USER_SIM_MODEL:-}" ]]; then
    export SIM_GPUS=${SIM_GPUS:-6,7} SIM_BASE_PORT=${SIM_BASE_PORT:-5000}
fi
FLAGS=()
if [[ "${1:-}" == --* ]]; then FLAGS=("$1"); shift; fi  # --dry-run, --plan, --trace come first
TURNS=()
if [[ -n "${MODEL_PATH:-}" && "${PRESET:-gpu}" == gpu* ]]; then TURNS=(rollout_loop.config.max_turns=12); fi
SIM_INSTANCES=2 SIM_TP=1 exec bash scripts/main.sh "${FLAGS[@]}" "${TURNS[@]}" "$@"
