"""A PPO (GAE) step through the trainer with padding-free forwards, token-budget micro-batches, gradient
checkpointing and the offload keys on (actor, reference and critic) equals the same step with all of them off."""
import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # 40 s measured: make test-extended (CI), not make test

COMPARED = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm",
            "critic/values/mean", "response_length/mean")
LONG_DIALOGUE_KEYS = (
    "actor_rollout_ref.model.use_remove_padding=true", "critic.model.use_remove_padding=true",
    "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=300",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=200", "critic.ppo_max_token_len_per_gpu=250",
    "actor_rollout_ref.model.enable_gradient_checkpointing=true", "critic.model.enable_gradient_checkpointing=true",
    "actor_rollout_ref.actor.fsdp_config.param_offload=true",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
    "actor_rollout_ref.ref.fsdp_config.param_offload=true", "critic.model.fsdp_config.param_offload=true",
    "critic.model.fsdp_config.optimizer_offload=true",
)


@pytest.fixture()
def task_data(tmp_path):
    from verl.tasks.repeat_letter import make_dataset

    make_dataset(tmp_path / "data", train_size=32, val_size=4, seed=0)
    return tmp_path / "data"


def _run(model: str, data: Path, out: Path, extra: tuple[str, ...]) -> dict:
    from verl.trainer.config_schema import compose_config
    from verl.trainer.main_ppo import run_ppo

    overrides = [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={data / 'train.parquet'}",
        "data.max_response_length=8", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "critic.ppo_micro_batch_size_per_gpu=2", "algorithm.adv_estimator=gae",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.entropy_coeff=0.01", "trainer.total_training_steps=1", "trainer.logger=[jsonl]",
        "trainer.device=cpu", "trainer.val_before_train=false", "trainer.balance_batch=false",
        f"trainer.default_local_dir={out / 'ckpt'}", f"trainer.log_dir={out / 'logs'}", *extra,
    ]  # fmt: skip
    run_ppo(compose_config(overrides))
    lines = (out / "logs" / "metrics.jsonl").read_text().splitlines()
    return {json.loads(line)["step"]: json.loads(line) for line in lines}[1]


def test_long_dialogue_keys_give_the_same_training_step(tiny_model_path, task_data, tmp_path, ray_cluster):
    plain = _run(tiny_model_path, task_data, tmp_path / "plain", ())
    packed = _run(tiny_model_path, task_data, tmp_path / "packed", LONG_DIALOGUE_KEYS)
    for name in COMPARED:
        assert packed[name] == pytest.approx(plain[name], rel=1e-4, abs=1e-6), name
