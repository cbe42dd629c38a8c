"""A real training run (tiny model, 2 FSDP ranks on CPU, Ray) with ``adv_estimator=turn_gae`` and
``algorithm.diagnosis_reweight`` on: the critic is built and trained, the per-turn rewards and labels a reward
plug-in writes follow their rows through balancing, and the advantages the actor trained on are the turn-level
GAE of the batch's own values and rewards, scaled on the labelled turns only: checked against the float64 loops of
tests/helpers/credit_reference.py, which also show that a deliberately wrong turn GAE (lam ignored) differs."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import credit_reference

from verl.protocol import DataProto
from verl.trainer.ppo.plugins import SingleTurnRollout
from verl.utils.agent_turns import agent_turn_ids_from_mask

LABEL_WEIGHTS = {"false_claim": 2.0, "truncated": 0.5}


class SplitTurnsLoop(SingleTurnRollout):
    """Rollout-loop plug-in for the test: single-turn generation, then a response of 3+ tokens treats its second
    token as a user turn (``response_mask`` 0 there), so it has two agent turns."""

    def run_llm_loop(self, gen_batch: DataProto) -> DataProto:
        """Generate; cut the longer responses into agent turn, user token, agent turn."""
        out = super().run_llm_loop(gen_batch)
        mask = out.batch["response_mask"].clone()
        mask[mask.sum(dim=-1) >= 3, 1] = 0
        out.batch["response_mask"] = mask
        return out


def expected_turn_labels(responses: torch.Tensor, mask: torch.Tensor) -> list[list[list[str]]]:
    """The labels the test reward gives, from each row's own tokens: turn 0 of a row whose first token id is even
    is a false_claim; a second turn is truncated and carries a label without a weight."""
    labels = []
    turn_counts = (agent_turn_ids_from_mask(mask).max(dim=-1).values + 1).tolist()
    for row, count in enumerate(turn_counts):
        per_turn = [["false_claim"] if k == 0 and int(responses[row, 0]) % 2 == 0 else [] for k in range(count)]
        if count > 1:
            per_turn[1] = ["truncated", "not_in_the_table"]
        labels.append(per_turn)
    return labels


def turn_credit_reward(data: DataProto, tokenizer, **kwargs):
    """The built-in task's reward, plus per-turn scores (on each turn's last token) and per-turn labels."""
    from verl.tasks.repeat_letter import compute_reward

    scores, metrics = compute_reward(data, tokenizer, **kwargs)
    mask = data.batch["response_mask"]
    ids = agent_turn_ids_from_mask(mask)
    turn_scores = torch.zeros(mask.shape)
    for row in range(mask.shape[0]):
        sign = 1.0 if int(data.batch["responses"][row, 0]) % 2 == 0 else -1.0
        for k in range(int(ids[row].max()) + 1):
            last = int((ids[row] == k).nonzero().max())
            turn_scores[row, last] = 0.25 * sign * (k + 1)
    data.batch["turn_scores"] = turn_scores
    labels = np.empty(mask.shape[0], dtype=object)
    labels[:] = expected_turn_labels(data.batch["responses"], mask)
    data.non_tensor_batch["turn_labels"] = labels
    return scores, metrics


@pytest.mark.slow
@pytest.mark.extended  # 54 s measured: make test-extended (CI), kept out of make test's 20 minutes
def test_turn_gae_with_diagnosis_reweight_trains_and_keeps_rows_aligned(tiny_model_path, tmp_path, ray_cluster):
    from verl.single_controller.ray import RayResourcePool
    from verl.tasks.repeat_letter import make_dataset
    from verl.trainer.config_schema import compose_config
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, Role
    from verl.utils.dataset import load_tokenizer
    from verl.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker

    make_dataset(tmp_path / "data", train_size=32, val_size=4, seed=0)
    here = "tests.verl.trainer.test_turn_credit_training"
    config = compose_config([
        f"actor_rollout_ref.model.path={tiny_model_path}", f"data.train_files={tmp_path / 'data' / 'train.parquet'}",
        "data.max_response_length=4", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "critic.ppo_micro_batch_size_per_gpu=2", "algorithm.adv_estimator=turn_gae", "algorithm.gamma=0.9",
        "algorithm.lam=0.8", "algorithm.diagnosis_reweight.enable=true", "algorithm.diagnosis_reweight.apply_to=all",
        "+algorithm.diagnosis_reweight.weights={false_claim:2.0,truncated:0.5}",
        f"rollout_loop.path={here}.SplitTurnsLoop", f"reward.path={here}.turn_credit_reward",
        "trainer.total_training_steps=2", "trainer.n_gpus_per_node=2", "trainer.device=cpu",
        "trainer.logger=[jsonl]", "trainer.val_before_train=false", "trainer.balance_batch=true",
        "trainer.resume_mode=disable", f"trainer.default_local_dir={tmp_path / 'ckpt'}",
        f"trainer.log_dir={tmp_path / 'logs'}",
    ])
    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=2)
    trainer = RayPPOTrainer(config, load_tokenizer(tiny_model_path),
                            {Role.ActorRollout: ActorRolloutRefWorker, Role.Critic: CriticWorker}, pool)
    try:
        trainer.init_workers()
        trainer.fit()
    finally:
        trainer.shutdown()
        pool.remove()

    metrics = [json.loads(line) for line in (Path(tmp_path) / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for step in metrics:
        assert "critic/vf_loss" in step and "actor/pg_loss" in step and "critic/values/mean" in step
        assert step["diagnosis/reweighted_turns"] > 0 and 0.5 <= step["diagnosis/mean_weight"] <= 2.0
        assert step["diagnosis/unweighted_labels"] == step["diagnosis/turns/truncated"]

    batch = trainer.last_batch
    b = batch.batch
    mask = b["response_mask"]
    assert int((agent_turn_ids_from_mask(mask).max(dim=-1).values >= 1).sum()) > 0, "no row had two agent turns"
    labels = list(batch.non_tensor_batch["turn_labels"])
    assert labels == expected_turn_labels(b["responses"], mask), "labels did not follow their rows"
    ids = agent_turn_ids_from_mask(mask)
    plain, returns = credit_reference.turn_gae(b["token_level_rewards"], b["values"], mask, ids, b["turn_scores"],
                                               0.9, 0.8)
    expected = credit_reference.diagnosis(plain, ids, labels, LABEL_WEIGHTS, "all")
    on_turns = mask != 0
    f64 = torch.float64
    torch.testing.assert_close(b["advantages"].double()[on_turns], torch.tensor(expected, dtype=f64)[on_turns],
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b["returns"].double()[on_turns], torch.tensor(returns, dtype=f64)[on_turns],
                               rtol=1e-5, atol=1e-6)
    assert bool((b["advantages"][mask == 0] == 0).all()), "advantage on a user token"
    wrong, _ = credit_reference.turn_gae(b["token_level_rewards"], b["values"], mask, ids, b["turn_scores"], 0.9, 1.0)
    wrong = torch.tensor(credit_reference.diagnosis(wrong, ids, labels, LABEL_WEIGHTS, "all"), dtype=f64)
    assert not torch.allclose(b["advantages"].double()[on_turns], wrong[on_turns], rtol=1e-5, atol=1e-6), \
        "the check cannot tell a turn GAE that ignores lam apart"
