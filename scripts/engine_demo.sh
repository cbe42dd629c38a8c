#!/usr/bin/env bash
# The engine demo: single-turn GRPO on the built-in "repeat the letter" task (no dialogues, no simulator).
#
# It builds the tiny local model (outputs/tiny_model), writes the built-in task (outputs/data/repeat_letter) and
# trains it with GRPO on Ray with 2 FSDP workers on gloo, validating and checkpointing as it goes: a check that
# the engine learns, in about a minute on 2 cores. Every setting can be overridden with environment variables or
# extra `key=value` config overrides:
#
#   MODEL_PATH=/models/Qwen2.5-0.5B-Instruct N_GPUS=6 STEPS=100 bash scripts/engine_demo.sh actor_rollout_ref.actor.optim.lr=1e-6
#
# The dialogue training (the SEAD main job) is scripts/main.sh.
set -euo pipefail
SEAD_CALLER_DIR=$PWD
cd "$(dirname "$0")/.."
source scripts/python_env.sh
sead_find_python  # PYTHON unset: `python` when it has the project, else the checkout's .venv
OUTPUT_DIR=${OUTPUT_DIR:-outputs}
MODEL_PATH=${MODEL_PATH:-}
DATA_DIR=${DATA_DIR:-$OUTPUT_DIR/data/repeat_letter}
EXPERIMENT=${EXPERIMENT:-cpu_demo}
N_GPUS=${N_GPUS:-2}
STEPS=${STEPS:-20}
ROLLOUT_N=${ROLLOUT_N:-8}
LR=${LR:-2e-2}
CKPT_DIR=${CKPT_DIR:-$OUTPUT_DIR/checkpoints/$EXPERIMENT}
LOG_DIR=${LOG_DIR:-$OUTPUT_DIR/logs/$EXPERIMENT}

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1}
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}

if [[ -z "$MODEL_PATH" ]]; then
    MODEL_PATH=$("$PYTHON" -m utils.make_tiny_model --out "$OUTPUT_DIR/tiny_model" | tail -n 1)
fi
if [[ ! -f "$DATA_DIR/train.parquet" ]]; then
    "$PYTHON" -m verl.tasks.repeat_letter --out_dir "$DATA_DIR"
fi

"$PYTHON" -m verl.trainer.main_ppo \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    data.train_files="$DATA_DIR/train.parquet" \
    data.val_files="$DATA_DIR/val.parquet" \
    data.train_batch_size=8 \
    data.max_prompt_length=32 \
    data.max_response_length=4 \
    algorithm.adv_estimator=grpo \
    actor_rollout_ref.rollout.n="$ROLLOUT_N" \
    actor_rollout_ref.actor.ppo_mini_batch_size=8 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.actor.optim.lr="$LR" \
    trainer.n_gpus_per_node="$N_GPUS" \
    trainer.experiment_name="$EXPERIMENT" \
    trainer.total_training_steps="$STEPS" \
    trainer.test_freq=5 \
    trainer.save_freq=5 \
    trainer.max_ckpt_to_keep=2 \
    trainer.logger='[console,jsonl,tensorboard]' \
    trainer.default_local_dir="$CKPT_DIR" \
    trainer.log_dir="$LOG_DIR" \
    "$@"

echo "checkpoints (HF format under global_step_N/actor): $CKPT_DIR"
echo "metrics (one JSON line per step):                  $LOG_DIR/metrics.jsonl"
echo "tensorboard:                                       $LOG_DIR/tensorboard"
