"""trainer.val_only: validate the loaded or resumed model at its step, log val/* and exit without training."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl.trainer.config_schema import ConfigError, compose_config
from verl.trainer.config_validation import load_config


def test_val_only_without_validation_data_is_a_clear_error(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    train = tmp_path / "train.parquet"
    train.write_bytes(b"x")
    base = [f"actor_rollout_ref.model.path={model}", f"data.train_files={train}"]
    assert load_config(compose_config(base)).trainer.val_only is False
    with pytest.raises(ConfigError, match=r"trainer\.val_only=true needs data\.val_files"):
        load_config(compose_config(base + ["trainer.val_only=true"]))
    assert load_config(compose_config(base + ["trainer.val_only=true", f"data.val_files={train}"])).trainer.val_only


def _fit(model: str, data: Path, out: Path, extra: list[str]) -> dict:
    from verl.single_controller.ray import RayResourcePool
    from verl.tasks.repeat_letter import compute_reward  # noqa: F401  (the default reward.path's module)
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, Role
    from verl.utils.dataset import load_tokenizer
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    config = compose_config([
        f"actor_rollout_ref.model.path={model}", f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'val.parquet'}", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
        "data.max_response_length=4", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "trainer.total_training_steps=3",
        "trainer.n_gpus_per_node=1", "trainer.device=cpu", "trainer.logger=[jsonl]", "trainer.val_before_train=false",
        f"trainer.default_local_dir={out / 'ckpt'}", f"trainer.log_dir={out / 'logs'}", *extra])
    pool = RayResourcePool([1], use_gpu=False, max_colocate_count=1)
    trainer = RayPPOTrainer(config, load_tokenizer(model), {Role.ActorRollout: ActorRolloutRefWorker}, pool)
    try:
        trainer.init_workers()
        return {"metrics": trainer.fit(), "step": trainer.global_steps}
    finally:
        trainer.shutdown()
        pool.remove()


@pytest.mark.slow
def test_val_only_validates_the_resumed_checkpoint_and_trains_nothing(tiny_model_path, tmp_path, ray_cluster):
    from verl.tasks.repeat_letter import make_dataset

    make_dataset(tmp_path / "data", train_size=16, val_size=8, seed=0)
    trained = _fit(tiny_model_path, tmp_path / "data", tmp_path, ["trainer.total_training_steps=1",
                                                                  "trainer.save_freq=1"])
    assert trained["step"] == 1 and (tmp_path / "ckpt" / "global_step_1").is_dir()
    log = tmp_path / "logs" / "metrics.jsonl"
    lines_before = log.read_text().splitlines()

    result = _fit(tiny_model_path, tmp_path / "data", tmp_path, ["trainer.val_only=true", "trainer.resume_mode=auto",
                                                                 "trainer.save_freq=1", "trainer.logger=jsonl",
                                                                 "trainer.log_val_generations=3"])
    assert result["step"] == 1, "val_only must validate the resumed step-1 model, not train on"
    assert "val/response_length/mean" in result["metrics"] and not any(k.startswith("actor/") for k in result["metrics"])
    new = [json.loads(line) for line in log.read_text().splitlines()[len(lines_before):]]
    assert [entry["step"] for entry in new] == [1], "exactly one log line, the validation at the resumed step"
    assert any(k.startswith("val/") for k in new[0]) and not any(k.startswith("actor/") for k in new[0])
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.is_dir()) == ["global_step_1"]

    # trainer.logger given as a string; the first 3 validation samples logged as a table (veRL's
    # log_val_generations), each input being one of the validation prompts, decoded independently here
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    table = [json.loads(line) for line in (tmp_path / "logs" / "val_generations.jsonl").read_text().splitlines()]
    assert [t["step"] for t in table] == [1] and table[0]["columns"] == ["input", "output", "score"]
    rows = table[0]["rows"]
    assert len(rows) == 3 and all(float(score) in (0.0, 1.0) for _, _, score in rows)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    prompts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
               for p in pq.read_table(tmp_path / "data" / "val.parquet").column("prompt").to_pylist()]
    assert all(row[0] in prompts for row in rows)
