#!/usr/bin/env bash
# The SEAD main job: train the service agent with GRPO against user simulators, with the state controller and
# the user-response cache on (config: verl/trainer/config/sead_trainer.yaml).
#
# Settings come from one of the presets (scripts/presets.sh), printed in one block at start; every value in it
# can be set in the environment. PRESET=cpu|gpu|gpu_lora|rehearsal picks one; by default a MODEL_PATH selects `gpu` (the
# SEAD paper's settings: 60 prompts x 8 dialogues, lr 1e-6 with warm-up, KL loss, 15 turns, ...) and no MODEL_PATH
# selects `cpu` (the embedded demo). `rehearsal` is the GPU preset on CPU with only the device and the sizes
# changed (run it from the vLLM environment: PATH=$PWD/.venv-vllm/bin:$PATH PRESET=rehearsal bash scripts/main.sh). PRINT_CONFIG_ONLY=1 (or --dry-run as the first argument) prints the preset
# (each value with its origin: preset or environment), the key=value arguments (origin: override, with the value
# each replaces) and the trainer command, then exits without building, starting or training anything; --plan (the first argument)
# prints the preset, then `python -m verl.trainer.plan`'s memory and time plan of that trainer command (the model's
# config.json must exist; vLLM need not be installed); --trace prints the preset, then `python -m
# verl.trainer.trace_preset`'s full-size trace of one step of that command on CPU beside the plan (a minute or two).
#
# First the scenario is checked (utils/check_scenario.py: it loads, its behaviour categories have rules), and
# running simulators named in USER_SIM_URLS must answer: errors come in seconds, before anything is built.
# With no settings this is the CPU demo: it builds the tiny local model (outputs/models/<experiment>/tiny_model)
# and warm-starts it with supervised fine-tuning on 1,024 scripted calls (utils/cpu_recipe.py; .../tiny_model_warm;
# WARM_START_STEPS=0 skips it), writes the prompt data (outputs/prompt_data), starts two scripted user simulators on loopback,
# trains a few steps on Ray with 2 FSDP workers on gloo, validates and checkpoints, stops the simulators it
# started, writes the HTML report (outputs/reports/) and prints where everything went. About 5 minutes on 2 cores.
#
# On a GPU box, point it at real models; the policy then generates with vLLM inside its FSDP workers (the GPU
# preset's ROLLOUT_ENGINE=vllm) and the simulators are vLLM servers (requirements_vllm.txt env):
#
#   MODEL_PATH=/models/Qwen2.5-14B-Instruct USER_SIM_MODEL=/models/Qwen2.5-14B-Instruct \
#     bash scripts/main.sh [key=value config overrides ...]
#
# (scripts/2ins_main.sh: the same with two one-GPU simulator instances on ports 5000/5001 and 12 turns.) With
# USER_SIM_URLS set, already running simulators are used and none is started. The experiment name (checkpoints,
# logs, rollout log, cache, the demo's models) defaults to <model directory name>_<scenario name> on the GPU
# preset and cpu_demo_<scenario name> on the CPU one; the trainer refuses to resume a checkpoint of another model
# (trainer.resume_from_other_model=true forces it) or one trained with another tokenizer or scenario file.
# Environment besides the preset variables: PRESET, PRINT_CONFIG_ONLY, MODEL_PATH (the tiny model),
# USER_SIM_MODEL (none: scripted simulators), USER_SIM_URLS, SIM_INSTANCES (2 scripted; 1 vLLM), SIM_TP
# (1; 2 vLLM), SIM_MAX_MODEL_LEN (8192), SIM_GPU_MEMORY_UTILIZATION (0.9), SIM_EXTRA_ARGS (more vLLM flags),
# SIM_GPUS (6,7 vLLM; must not overlap POLICY_GPUS, the trainer's CUDA_VISIBLE_DEVICES), SIM_BASE_PORT (unset:
# free ports, one per instance; 5000 vLLM), SCENARIO (a path or a shipped scenario's name; python -m
# llm_agent.scenario prints the default; one per run: a trainer override naming another is refused),
# WARM_START_STEPS (the CPU recipe's, tiny model only; 0 skips the warm start),
# AGENT_PROMPT_FILE (the agent's system prompt written into the prompt data; default the scenario's, for the tiny
# model its agent.compact_prompt), OUTPUT_DIR (outputs), PYTHON (unset: `python` when it has the
# project's packages, else the checkout's .venv, or .venv-vllm for the rehearsal; scripts/python_env.sh says which).
# ITERATIONS=N (> 1) trains in iterations as the original SEAD did (train, analyse the mistakes, write the next
# profiles, continue from the last checkpoint; rerun to resume): see scripts/iterations.sh for its variables.
set -euo pipefail
SEAD_CALLER_DIR=$PWD
cd "$(dirname "$0")/.."
source scripts/python_env.sh
source scripts/presets.sh
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
for _arg in "$@"; do  # one scenario per run: the prompt data, the simulators and the trainer all use $SCENARIO
    case "$_arg" in
        rollout_loop.config.scenario=*|reward.kwargs.scenario=*) _other=${_arg#*=} ;;
        format_prompt=*) _other=verl/trainer/config/format_prompt/${_arg#*=}.yaml ;;
        *) continue ;;
    esac
    if [[ "$(realpath -m "$_other")" != "$(realpath -m "$SCENARIO")" ]]; then
        echo "$_arg disagrees with SCENARIO=$SCENARIO (the prompt data and the simulators use SCENARIO): set the" \
             "scenario with SCENARIO=... only" >&2
        exit 2
    fi
done
if [[ -n "${PRESET:-}" ]]; then WHY="PRESET=$PRESET in the environment"; fi
if [[ -n "$MODEL_PATH" ]]; then
    PRESET=${PRESET:-gpu}; WHY=${WHY:-"MODEL_PATH is set"}; TINY_DEMO=0; DEMO_ARGS=()
else                                 # the demo's tiny model (built below), warm-started unless WARM_START_STEPS=0
    PRESET=${PRESET:-cpu}; WHY=${WHY:-"no MODEL_PATH: the tiny demo model"}; TINY_DEMO=1
    DEMO_ARGS=(data.max_prompt_length=96)  # its compact agent prompt (the scenario's agent.compact_prompt)
    WARM_START_STEPS=${WARM_START_STEPS:-}  # empty: the CPU recipe's; 0: no warm start
    MODEL_PATH=$([[ "$WARM_START_STEPS" == 0 ]] && echo tiny_model || echo tiny_model_warm)  # its name, for the preset
fi
sead_apply_preset "$PRESET"
# The demo's models are the experiment's own (its name includes the scenario), each rebuilt when what made it
# changed (utils/cpu_recipe.py: the recipe, the seed, the tag protocol; the warm start's also the scenario's
# content, the system prompt and the turn limit): another scenario's run never replaces or resumes them.
if [[ "$TINY_DEMO" == 1 ]]; then MODEL_PATH=$OUTPUT_DIR/models/$EXPERIMENT/$MODEL_PATH; fi
if [[ -n "$USER_SIM_MODEL" ]]; then  # GPU box: one vLLM instance on GPUs 6,7 (TP 2) unless told otherwise
    SIM_INSTANCES=${SIM_INSTANCES:-1}; SIM_TP=${SIM_TP:-2}; SIM_GPUS=${SIM_GPUS:-6,7}
else                                 # CPU: two scripted instances
    SIM_INSTANCES=${SIM_INSTANCES:-2}; SIM_TP=${SIM_TP:-1}; SIM_GPUS=${SIM_GPUS:-}
fi
if [[ "$POLICY_GPUS" != none ]]; then  # the trainer sees only its GPUs: no worker can land on a simulator's
    IFS=, read -r -a _policy <<< "$POLICY_GPUS"
    IFS=, read -r -a _sims <<< "$SIM_GPUS"
    if (( ${#_policy[@]} != N_GPUS )); then
        echo "POLICY_GPUS=$POLICY_GPUS lists ${#_policy[@]} GPUs but N_GPUS=$N_GPUS (trainer.n_gpus_per_node)" >&2
        exit 2
    fi
    for _gpu in "${_sims[@]}"; do
        if [[ ",$POLICY_GPUS," == *",$_gpu,"* ]]; then
            echo "GPU $_gpu is in both POLICY_GPUS=$POLICY_GPUS and SIM_GPUS=$SIM_GPUS" >&2
            exit 2
        fi
    done
fi
DATA_DIR=${DATA_DIR:-$OUTPUT_DIR/prompt_data/$EXPERIMENT}
CKPT_DIR=${CKPT_DIR:-$OUTPUT_DIR/checkpoints/$EXPERIMENT}
LOG_DIR=${LOG_DIR:-$OUTPUT_DIR/logs/$EXPERIMENT}
RUN_DIR=${RUN_DIR:-$OUTPUT_DIR/run/$EXPERIMENT}
ROLLOUT_LOG=${ROLLOUT_LOG:-$OUTPUT_DIR/rollouts/$EXPERIMENT/rollouts.jsonl}
VAL_METRICS=${VAL_METRICS:-$OUTPUT_DIR/evaluation/$EXPERIMENT/val_metrics.jsonl}

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1}
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
export PYTHON

# The trainer command (USER_SIM_URLS must be known).
trainer_command() {
    local -a extra correction=()
    read -r -a extra <<< "$PRESET_OVERRIDES"
    if [[ "$ROLLOUT_CORRECTION" != off ]]; then read -r -a correction <<< "$ROLLOUT_CORRECTION"; fi
    TRAIN_CMD=()
    if [[ "$POLICY_GPUS" != none ]]; then TRAIN_CMD=(env CUDA_VISIBLE_DEVICES="$POLICY_GPUS"); fi
    TRAIN_CMD+=("$PYTHON" -m verl.trainer.main_ppo --config-name sead_trainer
        actor_rollout_ref.model.path="$MODEL_PATH"
        actor_rollout_ref.model.enable_gradient_checkpointing="$GRAD_CKPT"
        data.train_files="$DATA_DIR/train.parquet"
        data.val_files="$DATA_DIR/test.parquet"
        data.train_batch_size="$TRAIN_PROMPTS"
        data.max_response_length="$RESPONSE_LENGTH"
        actor_rollout_ref.rollout.n="$ROLLOUT_N"
        actor_rollout_ref.rollout.temperature="$TEMPERATURE"
        actor_rollout_ref.rollout.name="$ROLLOUT_ENGINE"
        actor_rollout_ref.rollout.tensor_model_parallel_size="$ROLLOUT_TP"
        actor_rollout_ref.rollout.gpu_memory_utilization="$ROLLOUT_GPU_MEM"
        ${LOGPROB_MICRO_BATCH:+actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu="$LOGPROB_MICRO_BATCH"}
        ${LOGPROB_MICRO_BATCH:+actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu="$LOGPROB_MICRO_BATCH"}
        actor_rollout_ref.actor.ppo_mini_batch_size="$MINI_BATCH"
        ${MICRO_BATCH:+actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu="$MICRO_BATCH"}
        actor_rollout_ref.actor.use_dynamic_bsz="$USE_DYNAMIC_BSZ"
        ${MAX_TOKEN_LEN:+actor_rollout_ref.actor.ppo_max_token_len_per_gpu="$MAX_TOKEN_LEN"}
        ${LOGPROB_MAX_TOKEN_LEN:+actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu="$LOGPROB_MAX_TOKEN_LEN"}
        ${LOGPROB_MAX_TOKEN_LEN:+actor_rollout_ref.ref.log_prob_max_token_len_per_gpu="$LOGPROB_MAX_TOKEN_LEN"}
        ${LORA_RANK:+actor_rollout_ref.model.lora_rank="$LORA_RANK"}
        ${LORA_ALPHA:+actor_rollout_ref.model.lora_alpha="$LORA_ALPHA"}
        actor_rollout_ref.actor.optim.lr="$LR"
        actor_rollout_ref.actor.optim.lr_warmup_steps_ratio="$LR_WARMUP_RATIO"
        actor_rollout_ref.actor.use_kl_loss="$USE_KL_LOSS"
        actor_rollout_ref.actor.kl_loss_type="$KL_LOSS_TYPE"
        actor_rollout_ref.actor.kl_loss_coef="$KL_COEF"
        actor_rollout_ref.actor.entropy_coeff="$ENTROPY_COEFF"
        ${SEED:+data.seed="$SEED" actor_rollout_ref.actor.seed="$SEED" trainer.seed="$SEED"}
        ${SEED:+rollout_loop.config.seed="$SEED" rollout_loop.config.controller.seed="$SEED"}
        rollout_loop.config.scenario="$SCENARIO"
        rollout_loop.config.max_turns="$MAX_TURNS"
        rollout_loop.config.max_tokens_per_turn="$MAX_TOKENS_PER_TURN"
        rollout_loop.config.max_user_tokens="$MAX_USER_TOKENS"
        rollout_loop.config.user_sim.urls="'$USER_SIM_URLS'"
        rollout_loop.config.rollout_log_path="$ROLLOUT_LOG"
        rollout_loop.config.val_metrics_path="$VAL_METRICS"
        trainer.n_gpus_per_node="$N_GPUS"
        trainer.device="$DEVICE"
        trainer.experiment_name="$EXPERIMENT"
        trainer.total_training_steps="$STEPS"
        trainer.test_freq="$TEST_FREQ"
        trainer.save_freq="$SAVE_FREQ"
        trainer.max_ckpt_to_keep="$MAX_CKPT"
        trainer.save_hf_model="$SAVE_HF_MODEL"
        trainer.logger='[console,jsonl,tensorboard]'
        trainer.default_local_dir="$CKPT_DIR"
        trainer.log_dir="$LOG_DIR"
        "${DEMO_ARGS[@]}" "${correction[@]}" "${extra[@]}" "${ARGS[@]}")
}
ARGS=("$@")

# The trainer's CUDA allocator: expandable segments (less fragmentation when sequence lengths vary between micro-batches).
# Exported after the simulators started, so that their vLLM servers keep their own allocator settings.
trainer_environment() {
    if [[ "$DEVICE" == cuda ]]; then export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}; fi
}

sead_print_preset "$PRESET" "$WHY"
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
# STEPS is the total number of steps: a checkpoint already at STEPS or beyond means this run would train nothing.
if (( ITERATIONS <= 1 )) && [[ " ${ARGS[*]} " != *" trainer.resume_mode=disable "* ]]; then
    _total=$STEPS
    for _arg in "${ARGS[@]}"; do [[ "$_arg" != trainer.total_training_steps=* ]] || _total=${_arg#*=}; done
    _done=$( { find "$CKPT_DIR" -maxdepth 1 -name 'global_step_*' 2> /dev/null || true; } \
            | sed -n 's/.*global_step_\([0-9]*\)$/\1/p' | sort -n | tail -n 1)
    if [[ -n "$_done" && "$_total" =~ ^[0-9]+$ ]] && (( _done >= _total )); then
        echo "WARNING: nothing to train: $CKPT_DIR already holds step $_done and STEPS=$_total is the" \
             "total number of steps, not the steps to add: the run would resume there and train nothing." \
             "STEPS=$((_done + _total)) trains $_total more; another EXPERIMENT (or trainer.resume_mode=disable)" \
             "starts anew" >&2
    fi
fi
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
    if (( ${#ARGS[@]} )); then  # the third origin of a value, after preset and environment: a key=value argument
        echo "overrides (key=value arguments: last in the command, so they win):"
        preset_part=("${TRAIN_CMD[@]:head:${#TRAIN_CMD[@]}-head-${#ARGS[@]}}")
        for arg in "${ARGS[@]}"; do
            was=""
            for earlier in "${preset_part[@]}"; do [[ "${earlier%%=*}" != "${arg%%=*}" ]] || was=${earlier#*=}; done
            shown=$arg; [[ "$arg" =~ ^[A-Za-z0-9_./:=,@+-]*$ ]] || shown="'${arg//\'/\'\\\'\'}'"
            echo "  $shown    override${was:+, replacing '$was' set above}"
        done
    fi
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
