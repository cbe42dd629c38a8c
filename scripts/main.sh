#!/usr/bin/env bash
# The SEAD main job: train the service agent with GRPO against user simulators, with the state controller and
# the user-response cache on (config: verl/trainer/config/sead_trainer.yaml).
#
#   [PRESET=cpu|gpu|gpu_lora|rehearsal] [MODEL_PATH=...] bash scripts/main.sh [--dry-run|--plan|--trace] [key=value ...]
#
# Every training setting is a trainer key with one name (rollout_loop.config.max_turns, trainer.total_training_steps,
# ...): a preset (a YAML group, verl/trainer/config/preset/NAME.yaml) gives the run's values over sead_trainer.yaml
# and key=value arguments win over it; launch.* keys are this script's (launch.seed, launch.train_samples,
# launch.test_samples, launch.policy_gpus). python -m verl.trainer.launch_settings resolves them; this script
# starts the processes and passes the keys, printing every value that the preset, it or the command line set, with
# where it came from. By default a MODEL_PATH selects `gpu` (the SEAD paper's settings) and no MODEL_PATH `cpu`
# (the embedded demo); `rehearsal` is the GPU preset on CPU with only the device and the sizes changed (run it
# from the vLLM environment: PATH=$PWD/.venv-vllm/bin:$PATH PRESET=rehearsal bash scripts/main.sh).
# --dry-run (or PRINT_CONFIG_ONLY=1) prints the settings and the trainer command, then exits without building,
# starting or training anything; --plan prints them, then `python -m verl.trainer.plan`'s memory and time plan of
# that command (the model's config.json must exist; vLLM need not be installed); --trace `python -m
# verl.trainer.trace_preset`'s full-size trace of one step of that command on CPU beside the plan.
#
# First the scenario is checked (utils/check_scenario.py) and running simulators named in USER_SIM_URLS must
# answer: errors come in seconds, before anything is built. With no settings this is the CPU demo: it builds the
# tiny model (outputs/models/<experiment>/tiny_model) and warm-starts it (utils/cpu_recipe.py;
# .../tiny_model_warm; WARM_START_STEPS=0 skips it), writes the prompt data, starts two scripted user simulators
# on loopback, trains a few steps with 2 FSDP workers on gloo, validates and checkpoints, stops the simulators it
# started, writes the HTML report (outputs/reports/) and prints where everything went. About 5 minutes on 2 cores.
# On a GPU box: MODEL_PATH=/models/Qwen2.5-14B-Instruct USER_SIM_MODEL=/models/Qwen2.5-14B-Instruct bash
# scripts/main.sh (vLLM simulators; scripts/2ins_main.sh: two one-GPU instances and 12 turns). The trainer refuses
# to resume a checkpoint of another model, tokenizer or scenario file.
#
# Environment (process-level inputs, not training settings): PRESET, PRINT_CONFIG_ONLY, MODEL_PATH (unset: the
# tiny model), USER_SIM_MODEL (unset: scripted simulators), USER_SIM_URLS (running simulators: none is started),
# SIM_INSTANCES (2 scripted; 1 vLLM), SIM_TP (1; 2 vLLM), SIM_MAX_MODEL_LEN (8192), SIM_GPU_MEMORY_UTILIZATION
# (0.9), SIM_EXTRA_ARGS (more vLLM flags), SIM_GPUS (6,7 vLLM; must not overlap launch.policy_gpus), SIM_BASE_PORT
# (unset: free ports; 5000 vLLM), SCENARIO (a path or a shipped scenario's name; one per run: a key naming another
# is refused), WARM_START_STEPS (tiny model only; 0: no warm start), AGENT_PROMPT_FILE (the agent's system prompt
# in the prompt data), OUTPUT_DIR (outputs), RUN_DIR (the simulators' pids and logs), PYTHON (unset:
# scripts/python_env.sh finds one) and ITERATIONS=N (scripts/iterations.sh). The old preset variables (MAX_TURNS,
# STEPS, SEED, ...) are refused with the key that replaces each.
set -euo pipefail
SEAD_CALLER_DIR=$PWD
cd "$(dirname "$0")/.."
source scripts/python_env.sh
source scripts/iterations.sh

DRY_RUN=${PRINT_CONFIG_ONLY:-0}
PLAN=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=1; shift; fi
if [[ "${1:-}" == "--plan" ]]; then DRY_RUN=1; PLAN=1; shift; fi
if [[ "${1:-}" == "--trace" ]]; then DRY_RUN=1; PLAN=trace; shift; fi
sead_find_python $([[ "${PRESET:-}" == rehearsal ]] && echo vllm)  # PYTHON unset: one with the project
OUTPUT_DIR=${OUTPUT_DIR:-outputs}
MODEL_PATH=${MODEL_PATH:-}
USER_SIM_MODEL=${USER_SIM_MODEL:-}
USER_SIM_URLS=${USER_SIM_URLS:-}
if [[ -n "$USER_SIM_URLS" ]]; then  # checked as the client checks them, --dry-run too; read from the environment,
    # as a refused URL may carry a credential that must reach no command line (nor this script's output)
    USER_SIM_URLS="$USER_SIM_URLS" "$PYTHON" -m utils.check_simulators --syntax-only >/dev/null || exit 2
fi
# The scenario first, in about a second, before anything is built or started: it must load, and every behaviour
# category of its library needs a rule in the controller's rule table (utils/check_scenario.py; a name such as
# inbound_support stands for the shipped file). Only this file is read: other drafts in format_prompt/ do not matter.
CHECK_ARGS=()
for _arg in "$@"; do
    case "$_arg" in
        rollout_loop.config.controller.rules_path=*) CHECK_ARGS+=(--rules "${_arg#*=}") ;;
        rollout_loop.config.controller.profile_source=*) CHECK_ARGS+=(--profile-source "${_arg#*=}") ;;
    esac
done
CHECKED=$("$PYTHON" -m utils.check_scenario ${SCENARIO:+"$SCENARIO"} --for-scripts "${CHECK_ARGS[@]}") || exit 2
{ read -r SCENARIO_SUMMARY; read -r SCENARIO; read -r SCENARIO_COMPACT_PROMPT; } <<< "$CHECKED"  # SCENARIO: resolved
if [[ -n "$USER_SIM_MODEL" ]]; then  # GPU box: one vLLM instance on GPUs 6,7 (TP 2) unless told otherwise
    SIM_INSTANCES=${SIM_INSTANCES:-1}; SIM_TP=${SIM_TP:-2}; SIM_GPUS=${SIM_GPUS:-6,7}
else                                 # CPU: two scripted instances
    SIM_INSTANCES=${SIM_INSTANCES:-2}; SIM_TP=${SIM_TP:-1}; SIM_GPUS=${SIM_GPUS:-}
fi
if [[ -n "${PRESET:-}" ]]; then WHY="PRESET=$PRESET in the environment"; fi
LAUNCH_KEYS=()  # what this script sets: the model, the scenario and where the run's files go ({experiment}: its name)
if [[ -n "$MODEL_PATH" ]]; then
    PRESET=${PRESET:-gpu}; WHY=${WHY:-"MODEL_PATH is set"}; TINY_DEMO=0
    LAUNCH_KEYS+=(actor_rollout_ref.model.path="$MODEL_PATH")
else  # the demo's tiny model (built below, the experiment's own), warm-started unless WARM_START_STEPS=0
    PRESET=${PRESET:-cpu}; WHY=${WHY:-"no MODEL_PATH: the tiny demo model"}; TINY_DEMO=1
    WARM_START_STEPS=${WARM_START_STEPS:-}  # empty: the CPU recipe's; 0: no warm start
    LAUNCH_KEYS+=(actor_rollout_ref.model.path="$OUTPUT_DIR/models/{experiment}/$([[ "$WARM_START_STEPS" == 0 ]] \
                  && echo tiny_model || echo tiny_model_warm)"
                  data.max_prompt_length=96)  # its compact agent prompt (the scenario's agent.compact_prompt)
fi
LAUNCH_KEYS+=(rollout_loop.config.scenario="$SCENARIO"
              data.train_files="$OUTPUT_DIR/prompt_data/{experiment}/train.parquet"
              data.val_files="$OUTPUT_DIR/prompt_data/{experiment}/test.parquet"
              rollout_loop.config.rollout_log_path="$OUTPUT_DIR/rollouts/{experiment}/rollouts.jsonl"
              rollout_loop.config.val_metrics_path="$OUTPUT_DIR/evaluation/{experiment}/val_metrics.jsonl"
              trainer.default_local_dir="$OUTPUT_DIR/checkpoints/{experiment}"
              trainer.log_dir="$OUTPUT_DIR/logs/{experiment}")
# Every value, resolved in one place (and refused there: a second scenario, trainer GPUs miscounted or shared with
# SIM_GPUS; a warning when the checkpoints already reach the step count): EXPERIMENT, MODEL_PATH, STEPS, DEVICE,
# N_GPUS, MAX_TURNS, SEED, TRAIN_SAMPLES, TEST_SAMPLES, POLICY_GPUS, DATA_DIR, CKPT_DIR, LOG_DIR, ROLLOUT_LOG,
# VAL_METRICS, TRAIN_ARGS and SETTINGS_TEXT.
RESOLVED=$(SIM_GPUS="$SIM_GPUS" ITERATIONS="${ITERATIONS:-1}" "$PYTHON" -m verl.trainer.launch_settings "$PRESET" \
           "${LAUNCH_KEYS[@]}" -- "$@") || exit 2
eval "$RESOLVED"
RUN_DIR=${RUN_DIR:-$OUTPUT_DIR/run/$EXPERIMENT}

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1}
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
export PYTHON

# The trainer command (USER_SIM_URLS must be known; a urls key among the arguments comes later and wins).
trainer_command() {
    TRAIN_CMD=()
    if [[ "$POLICY_GPUS" != none ]]; then TRAIN_CMD=(env CUDA_VISIBLE_DEVICES="$POLICY_GPUS"); fi
    TRAIN_CMD+=("$PYTHON" -m verl.trainer.main_ppo --config-name sead_trainer
                rollout_loop.config.user_sim.urls="'$USER_SIM_URLS'" "${TRAIN_ARGS[@]}")
}

# The trainer's CUDA allocator: expandable segments (less fragmentation when sequence lengths vary between micro-batches).
# Exported after the simulators started, so that their vLLM servers keep their own allocator settings.
trainer_environment() {
    if [[ "$DEVICE" == cuda ]]; then export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}; fi
}

echo "preset: $PRESET ($WHY)"
echo "$SETTINGS_TEXT"
echo "model: $MODEL_PATH"
echo "placement: trainer on GPUs ${POLICY_GPUS/none/(CPU workers)}; simulators ${SIM_GPUS:-on CPU (scripted)}"
echo "$SCENARIO_SUMMARY: $SCENARIO"
if [[ "$TINY_DEMO" == 1 ]]; then  # the tiny model's system prompt: the scenario's agent.compact_prompt
    COMPACT_PROMPT=${SCENARIO_COMPACT_PROMPT}
    if [[ -n "${AGENT_PROMPT_FILE:-}" ]]; then COMPACT_PROMPT=$(cat "$AGENT_PROMPT_FILE"); fi
    echo "agent system prompt: $COMPACT_PROMPT"
elif [[ ! -d "$MODEL_PATH" ]]; then
    echo "warning: MODEL_PATH=$MODEL_PATH is not a directory on this machine: nothing is downloaded, the trainer" \
         "loads a local model directory only, so the path must exist where the run starts" >&2
fi
if [[ "$DEVICE" == cuda && -z "$USER_SIM_MODEL" && -z "$USER_SIM_URLS" ]]; then
    echo "warning: USER_SIM_MODEL is not set: this GPU run's users are the scripted simulators on CPU (set" \
         "USER_SIM_MODEL=<model dir> for LLM user simulators, or USER_SIM_URLS for running ones)" >&2
fi
if [[ -n "$USER_SIM_URLS" && "$DRY_RUN" == 0 ]]; then  # before anything is built: a dead URL fails in seconds
    "$PYTHON" -m utils.check_simulators "$USER_SIM_URLS" || exit 2
fi
sead_check_iterations
if [[ "$DRY_RUN" == 1 ]]; then
    USER_SIM_URLS=${USER_SIM_URLS:-<the $SIM_INSTANCES simulator(s) this script starts>}
    trainer_command
    trainer_environment
    head=5; if [[ "${TRAIN_CMD[0]}" == env ]]; then head=7; fi  # [env CUDA_VISIBLE_DEVICES=...] python -m ...
    if [[ "$PLAN" == 1 ]]; then  # the memory and time plan of exactly this trainer command
        exec "$PYTHON" -m verl.trainer.plan --config-name sead_trainer "${TRAIN_CMD[@]:head}"
    elif [[ "$PLAN" == trace ]]; then  # one step of exactly this trainer command traced at full size, beside the plan
        exec "$PYTHON" -m verl.trainer.trace_preset --config-name sead_trainer "${TRAIN_CMD[@]:head}"
    fi
    [[ -z "${PYTORCH_CUDA_ALLOC_CONF:-}" ]] || echo "trainer environment: PYTORCH_CUDA_ALLOC_CONF=$PYTORCH_CUDA_ALLOC_CONF"
    echo "trainer command:"
    line="  ${TRAIN_CMD[*]:0:head}"
    for arg in "${TRAIN_CMD[@]:head}"; do  # one key=value per line, single-quoted where the shell needs it
        [[ "$arg" =~ ^[A-Za-z0-9_./:=,@+-]*$ ]] || arg="'${arg//\'/\'\\\'\'}'"
        printf '%s \\\n' "$line"
        line="    $arg"
    done
    printf '%s\n' "$line"
    if (( ITERATIONS > 1 )); then sead_iterate --dry-run; fi
    exit 0
fi

PROMPT_ARGS=()
if [[ -n "${AGENT_PROMPT_FILE:-}" ]]; then PROMPT_ARGS=(--system_prompt "$(cat "$AGENT_PROMPT_FILE")"); fi
if [[ "$TINY_DEMO" == 1 ]]; then
    PROMPT_ARGS=(--system_prompt "$COMPACT_PROMPT")  # the scenario's full prompt is ~1300 tiny-model tokens
    # a random model never writes a tagged turn: the recipe's warm start gives RL something to start from (a few
    # minutes, once; reused while its inputs are unchanged)
    "$PYTHON" -m utils.cpu_recipe warm-model --out "$(dirname "$MODEL_PATH")" --scenario "$SCENARIO" \
        --system-prompt "$COMPACT_PROMPT" --seed "${SEED:-0}" --max-turns "$MAX_TURNS" \
        ${WARM_START_STEPS:+--steps "$WARM_START_STEPS"} > /dev/null
fi
"$PYTHON" -m utils.create_prompt_data --scenario "$SCENARIO" --train_samples "$TRAIN_SAMPLES" \
    --test_samples "$TEST_SAMPLES" --out_dir "$DATA_DIR" ${SEED:+--seed "$SEED"} "${PROMPT_ARGS[@]}" > /dev/null

STARTED_SIMS=0
stop_sims() {
    if [[ "$STARTED_SIMS" == 1 ]]; then
        bash scripts/stop_user_sims.sh --run-dir "$RUN_DIR" || true
    fi
}
trap stop_sims EXIT
if [[ -z "$USER_SIM_URLS" ]]; then
    if [[ -n "${SIM_BASE_PORT:-}" || -n "$USER_SIM_MODEL" ]]; then
        SIM_PORT_ARGS=(--num-instances "$SIM_INSTANCES" --base-port "${SIM_BASE_PORT:-5000}")
    else  # one free port per instance, all held at once (two instances never share one; base+1 may be taken)
        SIM_PORT_ARGS=(--ports "$("$PYTHON" -c 'import socket, sys
held = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in held: s.bind(("127.0.0.1", 0))
print(",".join(str(s.getsockname()[1]) for s in held))' "$SIM_INSTANCES")")
    fi
    SIM_ARGS=("${SIM_PORT_ARGS[@]}" --scenario "$SCENARIO" --run-dir "$RUN_DIR" --tp "$SIM_TP" ${SEED:+--seed "$SEED"})
    if [[ -n "$USER_SIM_MODEL" ]]; then
        SIM_ARGS+=(--model "$USER_SIM_MODEL" --max-model-len "${SIM_MAX_MODEL_LEN:-8192}"
                   --gpu-memory-utilization "${SIM_GPU_MEMORY_UTILIZATION:-0.9}")
    fi
    if [[ -n "$SIM_GPUS" ]]; then SIM_ARGS+=(--gpus "$SIM_GPUS"); fi
    STARTED_SIMS=1
    read -r -a SIM_EXTRA <<< "${SIM_EXTRA_ARGS:-}"  # further server flags, e.g. "--enforce-eager"
    if (( ${#SIM_EXTRA[@]} > 0 )); then SIM_ARGS+=(-- "${SIM_EXTRA[@]}"); fi
    USER_SIM_URLS=$(bash scripts/start_user_sims.sh "${SIM_ARGS[@]}" | tail -n 1)
fi
echo "user simulators: $USER_SIM_URLS"

trainer_command
trainer_environment
if (( ITERATIONS > 1 )); then
    sead_iterate
    echo "iterations (profiles, rollouts, mistakes per iteration): $ITER_ROOT"
else
    "${TRAIN_CMD[@]}"
fi

echo "checkpoints (HF format under global_step_N/actor): $CKPT_DIR"
echo "training metrics (one JSON line per step):        $LOG_DIR/metrics.jsonl"
echo "validation metrics (one JSON line per validation): $VAL_METRICS"
echo "rollout log (every dialogue of every step):        $ROLLOUT_LOG"
echo "user-response cache:                              $CKPT_DIR/user_response_cache.jsonl"
"$PYTHON" -m utils.val_summary "$VAL_METRICS" || true
"$PYTHON" -m utils.learning_signal "$LOG_DIR/metrics.jsonl" || true  # says so when no step could learn
REPORT=$("$PYTHON" -m for_evaluation.report "$LOG_DIR" --dialogues "$ROLLOUT_LOG" --scenario "$SCENARIO" \
    --out "$OUTPUT_DIR/reports/$EXPERIMENT.html")
echo "report (plots, metrics, mistakes, dialogues; open in a browser): $REPORT"
