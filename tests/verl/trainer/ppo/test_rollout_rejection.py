"""The rule of rollout rejection (verl/trainer/ppo/rollout_rejection.py) on small hand-computed batches: credit on the
dialogue as sampled, then the rejected tokens leave the loss. The combinations are in test_rejection_credit_grid.py."""
from __future__ import annotations

import pytest
import torch

from verl.errors import ContractError
from verl.protocol import DataProto
from verl.trainer.config_schema import AlgorithmConfig, RolloutCorrectionConfig
from verl.trainer.ppo.rollout_rejection import apply_rejection, credit_then_reject
from verl.trainer.ppo.trainer_advantage import advantage_step


def _dialogue(last_token_log_ratio: float) -> DataProto:
    """Two rows: agent turn (2 tokens), user turn (1), agent turn (2 tokens, the last one carrying the outcome 1.0);
    the engine agrees with the policy except on row 0's last token."""
    mask = torch.tensor([[1, 1, 0, 1, 1, 0], [1, 1, 0, 1, 1, 0]])
    rewards = torch.zeros(2, 6, dtype=torch.float64)
    rewards[:, 4] = 1.0
    old = torch.full((2, 6), -1.0, dtype=torch.float64) * mask
    rollout = old.clone()
    rollout[0, 4] -= last_token_log_ratio
    return DataProto.from_dict(tensors={
        "response_mask": mask, "token_level_rewards": rewards, "values": torch.zeros(2, 6, dtype=torch.float64),
        "old_log_probs": old, "rollout_log_probs": rollout})


def test_a_rejected_last_token_still_delivers_the_outcome_to_its_dialogue():
    """Issue 35's example: turn-level GAE (gamma = lam = 1, values 0) gives every agent token the return 1.0; token
    rejection of row 0's last token (k3 of a log-ratio of 2: 4.39) must not turn its other returns into 0."""
    batch = _dialogue(2.0)
    correction = RolloutCorrectionConfig(rollout_rs="token_k3", rollout_rs_threshold=0.5)
    algorithm = AlgorithmConfig(adv_estimator="turn_gae", gamma=1.0, lam=1.0, rollout_correction=correction)
    metrics = advantage_step(batch, algorithm)
    b = batch.batch
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 8)
    assert b["response_mask"].tolist() == [[1, 1, 0, 1, 0, 0], [1, 1, 0, 1, 1, 0]]
    assert b["agent_turn_ids"].tolist() == [[0, 0, -1, 1, -1, -1], [0, 0, -1, 1, 1, -1]]
    assert b["returns"][b["response_mask"] != 0].tolist() == [1.0] * 7
    assert b["advantages"][0, 4] == 0 and b["token_level_rewards"][0, 4] == 1.0


def test_credit_is_assigned_before_the_mask_changes():
    batch = _dialogue(0.0)
    kept = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 0, 1, 1, 0]])
    seen = {}

    def credit(b: DataProto) -> dict[str, float]:
        seen["mask"] = b.batch["response_mask"].clone()
        b.batch["advantages"] = torch.ones(2, 6, dtype=torch.float64)
        b.batch["returns"] = b.batch["advantages"]  # an estimator may return one tensor as both
        return {"credit": 1.0}

    assert credit_then_reject(batch, kept, credit) == {"credit": 1.0}
    assert seen["mask"].tolist() == [[1, 1, 0, 1, 1, 0]] * 2
    assert torch.equal(batch.batch["response_mask"], kept)
    assert torch.equal(batch.batch["advantages"], kept.double())
    assert torch.equal(batch.batch["returns"], torch.ones(2, 6, dtype=torch.float64)), "returns are left as computed"
    assert batch.batch["agent_turn_ids"].tolist() == [[0, 0, -1, -1, -1, -1], [0, 0, -1, 1, 1, -1]]
    untouched = _dialogue(0.0)
    credit_then_reject(untouched, None, credit)
    assert "agent_turn_ids" not in untouched.batch.keys() and untouched.batch["response_mask"].sum() == 8


def test_a_rejection_mask_must_fit_the_response_mask():
    batch = _dialogue(0.0)
    with pytest.raises(ContractError, match="shape"):
        apply_rejection(batch, torch.ones(2, 5))
    with pytest.raises(ContractError, match="keeps a token that response_mask does not hold"):
        apply_rejection(batch, torch.ones(2, 6))
    assert batch.batch["response_mask"].sum() == 8, "nothing changed"
