#!/usr/bin/env bash
# The SEAD main job with two user-simulator instances of one GPU each (ports 5000 and 5001 on GPUs 6 and 7 when
# USER_SIM_MODEL is set); the policy workers keep GPUs 0-5. Everything else is scripts/main.sh (same presets,
# environment variables, PRINT_CONFIG_ONLY / --dry-run and key=value overrides), except that the GPU preset
# runs 12 agent turns per dialogue, as the SEAD paper's two-instance setup does (MAX_TURNS still wins). On CPU
# (no USER_SIM_MODEL) the simulators are the two scripted instances of scripts/main.sh. ITERATIONS=N trains in
# iterations exactly as scripts/main.sh does (scripts/iterations.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${USER_SIM_MODEL:-}" ]]; then
    export SIM_GPUS=${SIM_GPUS:-6,7} N_GPUS=${N_GPUS:-6} SIM_BASE_PORT=${SIM_BASE_PORT:-5000}
fi
SEAD_GPU_MAX_TURNS=12 SIM_INSTANCES=2 SIM_TP=1 exec bash scripts/main.sh "$@"
