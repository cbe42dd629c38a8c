"""Real trainer steps (tiny model, Ray, FSDP on CPU) with a rollout-loop plug-in that reports metrics and a
reward plug-in under which about two thirds of the prompt groups get one reward for every sample.

- The rollout loop's ``rollout/*`` metrics reach the tracked metrics of every step, and ``val/rollout/*`` those
  of validation (they used to be popped and dropped).
- With ``algorithm.filter_groups.enable`` the trained batch holds exactly ``train_batch_size`` prompt groups,
  none of them with a constant reward; extra prompt batches were generated (and consumed from the loader); the
  rollout loop's ``on_train_step_end`` saw that final batch; the effect is logged as ``filter_groups/*``.
- With it off, a step is one generation batch, constant groups stay, and no ``filter_groups/*`` is logged.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from verl.protocol import DataProto
from verl.trainer.ppo.plugins import RolloutLoop

STEPS, PROMPTS, N = 2, 4, 4
PROBE_SECONDS = 0.5  # the duration the probe reports per generation batch (summed over a step's batches)


def target_gets_varied_reward(target: str) -> bool:
    """Prompts whose target letter's code is divisible by 3 get a reward that varies over samples."""
    return ord(target) % 3 == 0


def parity_reward(data: DataProto, tokenizer) -> tuple[torch.Tensor, dict[str, float]]:
    """Reward plug-in: on the last loss token, the parity of the response's token-id sum for prompts whose
    target passes :func:`target_gets_varied_reward`, else a constant 0.5."""
    responses, mask = data.batch["responses"], data.batch["response_mask"]
    reward = torch.zeros(responses.shape, dtype=torch.float32)
    positions = torch.arange(responses.shape[1]).expand_as(mask)
    last = torch.where(mask.bool(), positions, torch.full_like(positions, -1)).max(dim=-1).values.clamp(min=0)
    for row, target in enumerate(data.non_tensor_batch["target"]):
        value = float((responses[row] * mask[row]).sum() % 2) if target_gets_varied_reward(target) else 0.5
        reward[row, last[row]] = value
    return reward, {"parity/rows": float(len(data))}


class ProbeRolloutLoop(RolloutLoop):
    """Rollout-loop plug-in: single-turn generation, metrics in ``meta_info['metrics']`` and a record of what
    ``on_train_step_end`` received."""

    def __init__(self, tokenizer, engine, config, is_validation):
        self.wg, self.is_validation = engine, is_validation
        self.calls = 0
        self.step_end_batches: list[DataProto] = []

    def run_llm_loop(self, gen_batch: DataProto) -> DataProto:
        """Generate and report the rows, the call number and a fixed duration as rollout metrics."""
        self.calls += 1
        out = self.wg.generate_sequences(DataProto(batch=gen_batch.batch, meta_info=gen_batch.meta_info))
        out.meta_info["metrics"] = {"rollout/probe_rows": float(len(out)), "rollout/probe_call": float(self.calls),
                                    "rollout/time_probe_s": PROBE_SECONDS}
        return out

    def on_train_step_end(self, batch: DataProto, step: int) -> dict[str, float]:
        """Keep the batch the trainer hands over after the step."""
        self.step_end_batches.append(batch)
        return {"probe/step_end_rows": float(len(batch))}


def _run(tiny_model_path: str, tmp_path: Path, filter_on: bool):
    from verl.single_controller.ray import RayResourcePool
    from verl.tasks.repeat_letter import make_dataset
    from verl.trainer.config_schema import compose_config
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, Role
    from verl.utils.dataset import load_tokenizer
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    data = tmp_path / "data"
    make_dataset(data, train_size=48, val_size=8, seed=3)
    overrides = [
        f"actor_rollout_ref.model.path={tiny_model_path}", f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'val.parquet'}", "algorithm.adv_estimator=grpo", f"actor_rollout_ref.rollout.n={N}",
        "data.max_response_length=4", f"data.train_batch_size={PROMPTS}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        f"trainer.total_training_steps={STEPS}", "trainer.device=cpu", "trainer.logger=[jsonl]",
        f"trainer.log_dir={tmp_path / 'logs'}", f"trainer.default_local_dir={tmp_path / 'ckpt'}",
        "trainer.resume_mode=disable", "trainer.val_before_train=true",
        "rollout_loop.path=tests.verl.trainer.test_ray_trainer_dynamic_sampling.ProbeRolloutLoop",
        "reward.path=tests.verl.trainer.test_ray_trainer_dynamic_sampling.parity_reward",
        f"algorithm.filter_groups.enable={str(filter_on).lower()}", "algorithm.filter_groups.max_num_gen_batches=30",
    ]
    pool = RayResourcePool([1], use_gpu=False, max_colocate_count=1)
    trainer = RayPPOTrainer(compose_config(overrides), load_tokenizer(tiny_model_path),
                            {Role.ActorRollout: ActorRolloutRefWorker}, pool)
    try:
        trainer.init_workers()
        loop = trainer.rollout_loop
        trainer.fit()
    finally:
        trainer.shutdown()
        pool.remove()
    lines = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    return trainer, loop, {json.loads(line)["step"]: json.loads(line) for line in lines}


def _rewards_by_group(batch: DataProto) -> dict[str, list[float]]:
    groups: dict[str, list[float]] = defaultdict(list)
    for uid, score in zip(batch.non_tensor_batch["uid"], batch.batch["token_level_scores"].sum(-1).tolist()):
        groups[uid].append(score)
    return groups


@pytest.mark.processes
def test_filter_groups_trains_on_groups_with_a_signal_and_logs_rollout_metrics(tiny_model_path, tmp_path,
                                                                               ray_cluster):
    trainer, loop, metrics = _run(tiny_model_path, tmp_path, filter_on=True)
    assert metrics[0]["val/rollout/probe_rows"] == 8.0, "validation rollout metrics must be logged under val/"
    gen_batches = [int(metrics[s]["filter_groups/num_gen_batches"]) for s in range(1, STEPS + 1)]
    assert sum(gen_batches) > STEPS, f"two thirds of the groups are constant: more batches were needed {gen_batches}"
    assert loop.calls == sum(gen_batches)
    consumed = trainer.train_loader.epoch * len(trainer.train_loader) + trainer.train_loader.batch_index
    assert consumed == sum(gen_batches), "every generation batch is a new prompt batch from the loader"
    for step, batches in zip(range(1, STEPS + 1), gen_batches):
        m = metrics[step]
        assert m["rollout/time_probe_s"] == pytest.approx(PROBE_SECONDS * batches), "durations add up"
        assert m["rollout/probe_rows"] == PROMPTS * N and m["reward/parity/rows"] == PROMPTS * N
        assert m["filter_groups/groups_generated"] == PROMPTS * batches and m["filter_groups/groups_kept"] == PROMPTS
        assert m["filter_groups/groups_zero_signal"] + m["filter_groups/groups_surplus"] == PROMPTS * (batches - 1)
        assert m["probe/step_end_rows"] == PROMPTS * N
    for batch in loop.step_end_batches:  # the hook saw the final filtered batch of each step
        groups = _rewards_by_group(batch)
        assert len(batch) == PROMPTS * N and len(groups) == PROMPTS
        assert all(len(r) == N and len(set(r)) > 1 for r in groups.values()), groups
        assert all(target_gets_varied_reward(t) for t in batch.non_tensor_batch["target"])
    assert loop.step_end_batches[-1] is trainer.last_batch
    assert any("." in uid.split("_")[0] for b in loop.step_end_batches for uid in b.non_tensor_batch["uid"]), \
        "groups of a later generation batch were trained on"


@pytest.mark.processes
def test_without_filter_groups_a_step_is_one_generation_batch(tiny_model_path, tmp_path, ray_cluster):
    trainer, loop, metrics = _run(tiny_model_path, tmp_path, filter_on=False)
    assert loop.calls == STEPS and not any(k.startswith("filter_groups/") for m in metrics.values() for k in m)
    for step in range(1, STEPS + 1):
        assert metrics[step]["rollout/time_probe_s"] == PROBE_SECONDS
        assert metrics[step]["rollout/probe_call"] == step
    assert metrics[0]["val/rollout/probe_rows"] == 8.0
    constant = [r for b in loop.step_end_batches for r in _rewards_by_group(b).values() if len(set(r)) == 1]
    assert constant and all(len(b) == PROMPTS * N for b in loop.step_end_batches)
