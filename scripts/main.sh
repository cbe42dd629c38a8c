#!/usr/bin/env bash
# The SEAD main job: train the service agent with GRPO against user simulators, with the state controller and
# the user-response cache on (config: verl/trainer/config/sead_trainer.yaml).
#
# With no settings on a machine without a GPU this is the embedded CPU default: it builds the tiny local model
# (outputs/tiny_model) and warm-starts it with two minutes of supervised fine-tuning on scripted calls
# (outputs/tiny_model_warm; WARM_START_STEPS=0 skips it), writes the prompt data (outputs/prompt_data), starts
# two scripted user simulators on loopback, trains a few steps on Ray with 2 FSDP workers on gloo, validates and
# checkpoints, stops the simulators it started, writes the HTML report (outputs/reports/) and prints where everything
# went. About 5 minutes on 2 cores.
#
# On a GPU box, point it at real models; the simulators are then vLLM servers (requirements_vllm.txt env):
#
#   MODEL_PATH=/models/Qwen2.5-7B-Instruct USER_SIM_MODEL=/models/Qwen2.5-32B-Instruct N_GPUS=6 STEPS=10 \
#     bash scripts/main.sh [key=value config overrides ...]
#
# (scripts/2ins_main.sh: the same with two one-GPU simulator instances on ports 5000/5001.) With USER_SIM_URLS
# set, already running simulators are used and none is started. Environment:
#   MODEL_PATH (tiny model), USER_SIM_MODEL (none: scripted simulators), USER_SIM_URLS, SIM_INSTANCES (2 scripted;
#   1 vLLM), SIM_TP (1; 2 vLLM), SIM_GPUS (6,7 vLLM), SIM_BASE_PORT (a free port; 5000 vLLM), SCENARIO,
#   N_GPUS (2), STEPS (4), ROLLOUT_N (4), TRAIN_PROMPTS (4 per step), TRAIN_SAMPLES (64), TEST_SAMPLES (8),
#   MAX_TURNS (4), LR (5e-4), WARM_START_STEPS (80, tiny model only), EXPERIMENT (cpu_demo), OUTPUT_DIR (outputs),
#   PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
OUTPUT_DIR=${OUTPUT_DIR:-outputs}
MODEL_PATH=${MODEL_PATH:-}
USER_SIM_MODEL=${USER_SIM_MODEL:-}
USER_SIM_URLS=${USER_SIM_URLS:-}
if [[ -n "$USER_SIM_MODEL" ]]; then  # GPU box: one vLLM instance on GPUs 6,7 (TP 2) unless told otherwise
    SIM_INSTANCES=${SIM_INSTANCES:-1}; SIM_TP=${SIM_TP:-2}; SIM_GPUS=${SIM_GPUS:-6,7}
else                                 # CPU: two scripted instances
    SIM_INSTANCES=${SIM_INSTANCES:-2}; SIM_TP=${SIM_TP:-1}; SIM_GPUS=${SIM_GPUS:-}
fi
SCENARIO=${SCENARIO:-verl/trainer/config/format_prompt/outbound_ad_trial.yaml}
EXPERIMENT=${EXPERIMENT:-cpu_demo}
N_GPUS=${N_GPUS:-2}
STEPS=${STEPS:-4}
ROLLOUT_N=${ROLLOUT_N:-4}
TRAIN_PROMPTS=${TRAIN_PROMPTS:-4}
TRAIN_SAMPLES=${TRAIN_SAMPLES:-64}
TEST_SAMPLES=${TEST_SAMPLES:-8}
MAX_TURNS=${MAX_TURNS:-4}
LR=${LR:-5e-4}
DATA_DIR=${DATA_DIR:-$OUTPUT_DIR/prompt_data/$EXPERIMENT}
CKPT_DIR=${CKPT_DIR:-$OUTPUT_DIR/checkpoints/$EXPERIMENT}
LOG_DIR=${LOG_DIR:-$OUTPUT_DIR/logs/$EXPERIMENT}
RUN_DIR=${RUN_DIR:-$OUTPUT_DIR/run/$EXPERIMENT}
ROLLOUT_LOG=${ROLLOUT_LOG:-$OUTPUT_DIR/rollouts/$EXPERIMENT/rollouts.jsonl}
VAL_METRICS=${VAL_METRICS:-$OUTPUT_DIR/evaluation/val_metrics.jsonl}

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1}
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
export WANDB_MODE=${WANDB_MODE:-offline}
export PYTHON

CPU_DEFAULT=()
if [[ -z "$MODEL_PATH" ]]; then
    # The tiny model never completes a call, so completion alone (the default reward) gives GRPO no signal; the
    # CPU default also pays for well-formed turns, good state estimates and no false "done" claims; and its
    # cache serves once a stage holds 2 replies (a few steps of 16 calls never fill the default 10).
    CPU_DEFAULT=(reward.kwargs.weights.format=4.0 reward.kwargs.weights.profile_accuracy=1.0
                 reward.kwargs.weights.false_positive=2.0 rollout_loop.config.cache.min_bucket_size=2)
    TINY=$("$PYTHON" utils/make_tiny_model.py --out "$OUTPUT_DIR/tiny_model" | tail -n 1)
    MODEL_PATH=$TINY
    WARM_START_STEPS=${WARM_START_STEPS:-80}
    if (( WARM_START_STEPS > 0 )); then  # a random model never writes a tagged turn: give RL something to start from
        MODEL_PATH="$OUTPUT_DIR/tiny_model_warm"
        if [[ ! -f "$MODEL_PATH/sft_log.json" || "$TINY/config.json" -nt "$MODEL_PATH/sft_log.json" ]]; then
            echo "warm start: $WARM_START_STEPS SFT steps of the tiny model on scripted calls (one or two minutes)"
            "$PYTHON" utils/sft_warm_start.py --model "$TINY" --out "$MODEL_PATH" --scenario "$SCENARIO" \
                --n-dialogues 32 --quality-mix good=1 --max-turns "$MAX_TURNS" --steps "$WARM_START_STEPS" \
                --max-length 2048 > /dev/null
        fi
    fi
fi
"$PYTHON" utils/create_prompt_data.py --scenario "$SCENARIO" --train_samples "$TRAIN_SAMPLES" \
    --test_samples "$TEST_SAMPLES" --out_dir "$DATA_DIR" > /dev/null

STARTED_SIMS=0
stop_sims() {
    if [[ "$STARTED_SIMS" == 1 ]]; then
        bash scripts/stop_user_sims.sh --run-dir "$RUN_DIR" || true
    fi
}
trap stop_sims EXIT
if [[ -z "$USER_SIM_URLS" ]]; then
    SIM_BASE_PORT=${SIM_BASE_PORT:-$([[ -n "$USER_SIM_MODEL" ]] && echo 5000 || "$PYTHON" -c \
        'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
    SIM_ARGS=(--num-instances "$SIM_INSTANCES" --base-port "$SIM_BASE_PORT" --scenario "$SCENARIO"
              --run-dir "$RUN_DIR" --tp "$SIM_TP")
    if [[ -n "$USER_SIM_MODEL" ]]; then SIM_ARGS+=(--model "$USER_SIM_MODEL"); fi
    if [[ -n "$SIM_GPUS" ]]; then SIM_ARGS+=(--gpus "$SIM_GPUS"); fi
    STARTED_SIMS=1
    USER_SIM_URLS=$(bash scripts/start_user_sims.sh "${SIM_ARGS[@]}" | tail -n 1)
fi
echo "user simulators: $USER_SIM_URLS"

"$PYTHON" -m verl.trainer.main_ppo --config-name sead_trainer \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    data.train_files="$DATA_DIR/train.parquet" \
    data.val_files="$DATA_DIR/test.parquet" \
    data.train_batch_size="$TRAIN_PROMPTS" \
    data.max_response_length=512 \
    actor_rollout_ref.rollout.n="$ROLLOUT_N" \
    actor_rollout_ref.actor.ppo_mini_batch_size="$TRAIN_PROMPTS" \
    actor_rollout_ref.actor.optim.lr="$LR" \
    rollout_loop.config.scenario="$SCENARIO" \
    rollout_loop.config.max_turns="$MAX_TURNS" \
    rollout_loop.config.max_tokens_per_turn=96 \
    rollout_loop.config.user_sim.urls="'$USER_SIM_URLS'" \
    rollout_loop.config.rollout_log_path="$ROLLOUT_LOG" \
    rollout_loop.config.val_metrics_path="$VAL_METRICS" \
    trainer.n_gpus_per_node="$N_GPUS" \
    trainer.experiment_name="$EXPERIMENT" \
    trainer.total_training_steps="$STEPS" \
    trainer.test_freq=2 \
    trainer.save_freq=2 \
    trainer.max_ckpt_to_keep=2 \
    trainer.logger='[console,jsonl,tensorboard]' \
    trainer.default_local_dir="$CKPT_DIR" \
    trainer.log_dir="$LOG_DIR" \
    "${CPU_DEFAULT[@]}" \
    "$@"

echo "checkpoints (HF format under global_step_N/actor): $CKPT_DIR"
echo "training metrics (one JSON line per step):        $LOG_DIR/metrics.jsonl"
echo "validation metrics (one JSON line per validation): $VAL_METRICS"
echo "rollout log (every dialogue of every step):        $ROLLOUT_LOG"
echo "user-response cache:                              $CKPT_DIR/user_response_cache.jsonl"
REPORT=$("$PYTHON" for_evaluation/report.py "$LOG_DIR" --dialogues "$ROLLOUT_LOG" --scenario "$SCENARIO" \
    --out "$OUTPUT_DIR/reports/$EXPERIMENT.html")
echo "report (plots, metrics, mistakes, dialogues; open in a browser): $REPORT"
