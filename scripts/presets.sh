# The training presets of scripts/main.sh and scripts/2ins_main.sh (sourced, not run).
#
# `sead_apply_preset cpu|gpu|gpu_lora|rehearsal` gives every preset variable below its preset value unless the
# environment already sets it (a non-empty value wins), and `sead_print_preset` prints them all in one block, each
# marked `preset` or `environment` (an empty value is not passed to the trainer: its config default applies). The
# GPU preset reproduces the SEAD paper's training settings; gpu_lora is the GPU preset training a LoRA adapter on 2
# GPUs; the CPU preset is the embedded demo (tiny model, 2 cores, minutes); the rehearsal is the GPU preset itself
# on CPU, with only the device and the sizes of SEAD_REHEARSAL_SIZES changed (tests/scripts/test_gpu_rehearsal.py
# runs it in CI; LORA_RANK=32 LORA_ALPHA=32 in the environment rehearse gpu_lora's keys). Edit a preset's values in
# its own block below.

# Every preset variable, in the order they are printed.
SEAD_PRESET_VARS=(EXPERIMENT SEED DEVICE N_GPUS STEPS TRAIN_PROMPTS ROLLOUT_N MINI_BATCH TRAIN_SAMPLES TEST_SAMPLES MAX_TURNS
                  MAX_TOKENS_PER_TURN MAX_USER_TOKENS RESPONSE_LENGTH LR LR_WARMUP_RATIO USE_KL_LOSS KL_LOSS_TYPE
                  KL_COEF ENTROPY_COEFF TEMPERATURE GRAD_CKPT MICRO_BATCH LOGPROB_MICRO_BATCH USE_DYNAMIC_BSZ
                  MAX_TOKEN_LEN LOGPROB_MAX_TOKEN_LEN TEST_FREQ SAVE_FREQ MAX_CKPT SAVE_HF_MODEL POLICY_GPUS
                  ROLLOUT_ENGINE ROLLOUT_TP ROLLOUT_GPU_MEM LORA_RANK LORA_ALPHA ROLLOUT_CORRECTION
                  PRESET_OVERRIDES)
declare -gA SEAD_PRESET_ORIGIN=()

# The policy's rollout engine on CPU: vllm when $PYTHON can import vLLM (the .venv-vllm environment), else hf.
_sead_cpu_engine() {
    if "${PYTHON:-python}" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("vllm") is None)' \
        2> /dev/null; then echo vllm; else echo hf; fi
}

# Give $1 the value $2 unless the environment set it (non-empty) or a preset applied before gave it one (the
# rehearsal's sizes); remember where it came from ($3, default `preset`).
_sead_default() {
    if [[ -n "${SEAD_PRESET_ORIGIN[$1]:-}" ]]; then
        return
    elif [[ -n "${!1:-}" ]]; then
        SEAD_PRESET_ORIGIN[$1]=environment
    else
        printf -v "$1" '%s' "$2"
        SEAD_PRESET_ORIGIN[$1]=${3:-preset}
    fi
}

# ------------------------------------------------------------------------------------------------ CPU preset
# The embedded demo: the CPU learning recipe (utils/cpu_recipe.py, also the CI learning test's and
# bench/learning.py's; measured per seed and CPU float path in BENCHMARKS.md): a small model (0.5M parameters, the
# scenario's tags as whole tokens, a compact agent prompt) warm-started on a mixture of scripted calls that complete
# and calls that mostly do not, then a few GRPO steps with the completion-only reward on 2 CPU workers. Its
# learning settings (steps, batch, lr, turn and token limits, the cache's bucket size) come from
# `python -m utils.cpu_recipe preset`; the rest is here. SEED seeds everything (model, warm start, data, trainer,
# controller, simulators). The policy generates with vLLM when the running Python has it (make vllm-env), else with
# HF generate. Validation (64 fixed profiles, greedy) runs before training and after the last step.
_sead_cpu_preset() {
    local name value
    _sead_default EXPERIMENT "cpu_demo_$(basename "${SCENARIO%.*}")"
    _sead_default SEED 0
    _sead_default DEVICE auto
    while read -r name value; do
        _sead_default "$name" "$value"
    done < <("${PYTHON:-python}" -m utils.cpu_recipe preset)
    _sead_default LR_WARMUP_RATIO 0.0
    _sead_default USE_KL_LOSS false
    _sead_default KL_LOSS_TYPE low_var_kl
    _sead_default KL_COEF 0.001
    _sead_default ENTROPY_COEFF 0.0
    _sead_default GRAD_CKPT false
    _sead_default USE_DYNAMIC_BSZ false
    _sead_default MAX_TOKEN_LEN ""
    _sead_default LOGPROB_MAX_TOKEN_LEN ""
    _sead_default TEST_FREQ "$STEPS"
    _sead_default SAVE_FREQ 2
    _sead_default MAX_CKPT 2
    _sead_default SAVE_HF_MODEL every
    _sead_default POLICY_GPUS none
    _sead_default ROLLOUT_ENGINE "$(_sead_cpu_engine)"
    _sead_default ROLLOUT_TP 1
    _sead_default ROLLOUT_GPU_MEM 0.5
    _sead_default LORA_RANK ""
    _sead_default LORA_ALPHA ""
    _sead_default ROLLOUT_CORRECTION off
}

# ------------------------------------------------------------------------------------------------ GPU preset
# The SEAD paper's settings: 60 prompts x 8 dialogues per step (one optimizer step), lr 1e-6 with 10% warm-up,
# KL loss low_var_kl 0.001, entropy bonus 0.001, temperature 1.2, 15 agent turns (12 with two simulator
# instances: scripts/2ins_main.sh sets SEAD_GPU_MAX_TURNS=12), gradient checkpointing, 6 policy GPUs (GPUs 6,7
# serve the simulator) with trainer.device=cuda (a CPU-only torch fails at once instead of training on the CPU),
# 50 steps (the paper's 5 iterations of 10), 30 fixed validation profiles. The
# per-dialogue budget of 6144 tokens fits 15 turns even at their limits (15 x (256 agent + 128 user + the role
# markers) < 6144), so a dialogue ends by its outcome or max_turns, not by running out of tokens; prompts up to
# sead_trainer.yaml's 2,048 tokens. Checkpoints keep the HF export only in the last one (a 14B fp32 export is
# ~56 GB; `python -m verl.model_merger` exports any other later). As the original: padding-free forwards and the
# reference model's parameters offloaded. Micro-batches by a token budget: 16,384 tokens (2 full dialogues) per
# actor update micro-batch, 32,768 per log-prob forward (`python -m verl.trainer.plan` at 14B: update 61.3 GB, 47.8
# GB for the reference pass: both fit 80 GB with the planner's 15% error to spare; README "GPU box"). The policy
# generates with vLLM: TP 2 engines colocated with the FSDP actor, 55% of each GPU while awake (at 14B the planner
# gives 74.6 of 80 GB with the actor's resident state beside it), CUDA graphs, asleep during training (level 2),
# weights synced in buckets. Rollout correction (README "Rollout correction"): the engine's log-probs of every
# sampled token come back with the dialogue, each token's loss is weighted by its truncated IS ratio (TIS, at most
# 2), and an agent turn whose mean k3 divergence between the engine's (bf16) and the actor's policy exceeds 0.01 is
# left out of the loss (one bad turn, not the whole dialogue).
_sead_gpu_preset() {
    _sead_default EXPERIMENT "$(basename "$MODEL_PATH")_$(basename "${SCENARIO%.*}")"
    _sead_default SEED ""
    _sead_default DEVICE cuda
    _sead_default N_GPUS 6
    _sead_default STEPS 50
    _sead_default TRAIN_PROMPTS 60
    _sead_default ROLLOUT_N 8
    _sead_default MINI_BATCH "$TRAIN_PROMPTS"
    _sead_default TRAIN_SAMPLES $((TRAIN_PROMPTS * STEPS))
    _sead_default TEST_SAMPLES 30
    _sead_default MAX_TURNS "${SEAD_GPU_MAX_TURNS:-15}"
    _sead_default MAX_TOKENS_PER_TURN 256
    _sead_default MAX_USER_TOKENS 128
    _sead_default RESPONSE_LENGTH 6144
    _sead_default LR 1e-6
    _sead_default LR_WARMUP_RATIO 0.1
    _sead_default USE_KL_LOSS true
    _sead_default KL_LOSS_TYPE low_var_kl
    _sead_default KL_COEF 0.001
    _sead_default ENTROPY_COEFF 0.001
    _sead_default TEMPERATURE 1.2
    _sead_default GRAD_CKPT true
    _sead_default MICRO_BATCH ""
    _sead_default LOGPROB_MICRO_BATCH ""
    _sead_default USE_DYNAMIC_BSZ true
    _sead_default MAX_TOKEN_LEN 16384
    _sead_default LOGPROB_MAX_TOKEN_LEN 32768
    _sead_default TEST_FREQ 5
    _sead_default SAVE_FREQ 5
    _sead_default MAX_CKPT 2
    _sead_default SAVE_HF_MODEL last
    _sead_default POLICY_GPUS "$(seq -s, 0 $((N_GPUS - 1)))"
    _sead_default ROLLOUT_ENGINE vllm
    _sead_default ROLLOUT_TP 2
    _sead_default ROLLOUT_GPU_MEM 0.55
    _sead_default LORA_RANK ""
    _sead_default LORA_ALPHA ""
    _sead_default ROLLOUT_CORRECTION "actor_rollout_ref.rollout.calculate_log_probs=true \
algorithm.rollout_correction.rollout_is=token algorithm.rollout_correction.rollout_rs=turn_mean_k3 \
algorithm.rollout_correction.rollout_rs_threshold=0.01"
    _sead_default PRESET_OVERRIDES "actor_rollout_ref.model.use_remove_padding=true \
actor_rollout_ref.ref.fsdp_config.param_offload=true actor_rollout_ref.rollout.enforce_eager=false \
actor_rollout_ref.rollout.free_cache_engine=true"
}

# ------------------------------------------------------------------------------------- GPU preset with LoRA
# The GPU preset training a LoRA adapter (rank 32, alpha 32, on every linear layer of the decoder) on a frozen bf16
# base instead of every weight, on 2 policy GPUs: the reference is the actor with its adapter disabled and the vLLM
# engine (one of TP 2) keeps the base and receives the adapter after every update. `python -m verl.trainer.plan`
# at 14B: the engine at 0.7 of each GPU (393,298 KV tokens) beside the actor's 16.7 GB is the peak, 72.7 GB; the
# actor update 37.8 GB (README "LoRA"). lr 1e-5: an adapter takes larger steps than full fine-tuning's 1e-6 (not
# tuned on a GPU yet).
declare -gA SEAD_LORA_VALUES=([LORA_RANK]=32 [LORA_ALPHA]=32 [LR]=1e-5 [N_GPUS]=2 [ROLLOUT_GPU_MEM]=0.7)
_sead_gpu_lora_preset() {
    local name
    for name in "${!SEAD_LORA_VALUES[@]}"; do
        _sead_default "$name" "${SEAD_LORA_VALUES[$name]}" lora
    done
    _sead_gpu_preset
}

# ------------------------------------------------------------------------------------- GPU preset rehearsal
# The GPU preset on CPU: every value above except the device and the sizes below (2 CPU workers as one TP-2 vLLM
# engine, 2 x 2 dialogues of up to 6 short turns, token budgets of about one and two rows, a checkpoint every
# step), so that a key added to the GPU preset is rehearsed too. 6 turns let a call end (the scripted persona's
# shortest completed call takes 5 agent turns; with 2 every call timed out and the rehearsal could not learn);
# whether it learns anything in 2 steps of 4 dialogues is chance: main.sh says after the run when no step had a
# signal. Without a MODEL_PATH it runs on the demo's tiny model. Its experiment is rehearsal_<model dir>_<scenario>:
# never a real run's checkpoints.
declare -gA SEAD_REHEARSAL_SIZES=(
    [DEVICE]=cpu [N_GPUS]=2 [POLICY_GPUS]=none [STEPS]=2 [TRAIN_PROMPTS]=2 [ROLLOUT_N]=2 [MINI_BATCH]=2
    [TRAIN_SAMPLES]=8 [TEST_SAMPLES]=2 [MAX_TURNS]=6 [MAX_TOKENS_PER_TURN]=64 [MAX_USER_TOKENS]=48
    [RESPONSE_LENGTH]=768 [MAX_TOKEN_LEN]=1024 [LOGPROB_MAX_TOKEN_LEN]=2048 [TEST_FREQ]=2 [SAVE_FREQ]=1
)
_sead_rehearsal_preset() {
    local name
    _sead_default EXPERIMENT "rehearsal_$(basename "$MODEL_PATH")_$(basename "${SCENARIO%.*}")" rehearsal
    for name in "${!SEAD_REHEARSAL_SIZES[@]}"; do
        _sead_default "$name" "${SEAD_REHEARSAL_SIZES[$name]}" rehearsal
    done
    _sead_gpu_preset
}

# Apply preset $1 (cpu | gpu | gpu_lora | rehearsal); needs MODEL_PATH and SCENARIO set. Exits with a message on another name.
sead_apply_preset() {
    case "$1" in
        cpu) _sead_cpu_preset ;;
        gpu) _sead_gpu_preset ;;
        gpu_lora) _sead_gpu_lora_preset ;;
        rehearsal) _sead_rehearsal_preset ;;
        *) echo "PRESET must be cpu, gpu, gpu_lora or rehearsal, got '$1'" >&2; exit 2 ;;
    esac
}

# Print the chosen preset ($1) and why ($2), then every preset variable with its value and origin.
sead_print_preset() {
    echo "preset: $1 ($2); any variable below can be set in the environment"
    local name
    for name in "${SEAD_PRESET_VARS[@]}"; do
        printf '  %-22s %-40s (%s)\n' "$name" "${!name:--}" "${SEAD_PRESET_ORIGIN[$name]}"
    done
}
