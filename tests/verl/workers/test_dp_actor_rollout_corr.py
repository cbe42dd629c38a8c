"""DataParallelPPOActor with rollout correction (in process, tiny model): batch ``rollout_is_weights`` reach the
loss token by token, and ``policy_loss.loss_mode=bypass_mode`` corrects against the rollout's log-probs it gets as
old ones, its loss normalised by the mini-batch's tokens before rejection. Expected losses are float64 loops over
the log-probs of a plain HF forward in float64; each test also tells a deliberately wrong loss apart."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from tests.helpers.hf_reference import hf_logprobs
from tests.helpers.ppo_batch_helpers import actor_config, make_ppo_batch
from tests.helpers.rollout_corr_reference import rejection
from transformers import AutoModelForCausalLM

from verl.trainer.ppo.rollout_corr_helper import compute_offpolicy_metrics
from verl.utils.agent_turns import AGENT_TURN_IDS, agent_turn_ids_from_mask
from verl.utils.optim import build_optimizer
from verl.workers.actor.dp_actor import DataParallelPPOActor


@pytest.fixture(scope="module")
def base_model(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)


def _actor(base_model, **overrides) -> DataParallelPPOActor:
    cfg = actor_config(use_kl_loss=False, entropy_coeff=0.0, **overrides)
    module = copy.deepcopy(base_model)
    return DataParallelPPOActor(cfg, module, build_optimizer(module.parameters(), cfg.optim))


def _reference_log_probs(base_model, data) -> torch.Tensor:
    return hf_logprobs(copy.deepcopy(base_model).double(), data).double()


def _ppo_token_loss(log_prob: float, old: float, a: float, low: float, high: float, c: float = 3.0) -> float:
    """One token's dual-clip PPO loss, float64."""
    ratio = math.exp(max(-20.0, min(20.0, log_prob - old)))
    loss = max(-a * ratio, -a * min(max(ratio, 1 - low), 1 + high))
    return min(loss, -a * c) if a < 0 else loss


def _token_mean_loss(log_probs, data, keep, weights=None, denominator=None, low=0.2, high=0.28) -> float:
    """sum over kept tokens of w * PPO loss, over ``denominator`` (default: the kept tokens)."""
    b = data.batch
    lp, old, adv = log_probs.tolist(), b["old_log_probs"].double().tolist(), b["advantages"].double().tolist()
    w = None if weights is None else weights.double().tolist()
    cells = [(i, t) for i, row in enumerate(keep.tolist()) for t, k in enumerate(row) if k]
    total = math.fsum(_ppo_token_loss(lp[i][t], old[i][t], adv[i][t], low, high) * (1.0 if w is None else w[i][t])
                      for i, t in cells)
    return total / (len(cells) if denominator is None else denominator)


def test_rollout_is_weights_weigh_each_token_loss(base_model):
    data = make_ppo_batch(8, base_model.config.vocab_size, seed=5)
    gen = torch.Generator().manual_seed(7)
    weights = (0.1 + 2.4 * torch.rand(data.batch["advantages"].shape, generator=gen)) * data.batch["response_mask"]
    data.batch["rollout_is_weights"] = weights
    actor = _actor(base_model, ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=4)
    loss = actor.update_policy(copy.deepcopy(data))["actor/pg_loss"][0]
    log_probs, mask = _reference_log_probs(base_model, data), data.batch["response_mask"]
    expected = _token_mean_loss(log_probs, data, mask, weights)
    assert loss == pytest.approx(expected, rel=1e-5)
    # the mean weight times the unweighted loss (all a constant weight could check) is another loss
    mean_weight = float(weights.sum() / mask.sum())
    assert mean_weight * _token_mean_loss(log_probs, data, mask) != pytest.approx(expected, rel=1e-2)


def test_bypass_mode_actor_corrects_against_the_rollout_log_probs(base_model):
    corr = {"rollout_is": "turn", "rollout_is_threshold": 2.0, "rollout_rs": "token_k3", "rollout_rs_threshold": 0.02,
            "loss_type": "ppo_clip"}
    actor = _actor(base_model, ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=4,
                   policy_loss={"loss_mode": "bypass_mode", "rollout_correction": corr})
    data = make_ppo_batch(8, base_model.config.vocab_size, seed=6)
    data.meta_info["micro_batch_size"] = 4
    current = actor.compute_log_prob(data)[0]
    gen = torch.Generator().manual_seed(0)
    data.batch["old_log_probs"] = current + 0.3 * torch.randn(current.shape, generator=gen)  # the rollout's
    data.batch[AGENT_TURN_IDS] = agent_turn_ids_from_mask(data.batch["response_mask"])
    metrics = actor.update_policy(copy.deepcopy(data))
    first = slice(0, 4)  # the first micro-batch sees the weights that computed `current`
    expected = compute_offpolicy_metrics(current[first], data.batch["old_log_probs"][first],
                                         data.batch["response_mask"][first])
    assert metrics["rollout_corr/kl"][0] == pytest.approx(expected["kl"], rel=1e-4)
    assert metrics["rollout_corr/k3_kl"][0] == pytest.approx(expected["k3_kl"], rel=1e-4)
    assert 0 < metrics["rollout_corr/rollout_rs_masked_fraction"][0] < 1
    assert len(metrics["rollout_corr/rollout_is_mean"]) == 2  # one value per micro-batch

    # the loss: PPO-clip against the rollout on the tokens token_k3 keeps, over ALL the mini-batch's tokens (the
    # actor's counts are taken before the loss rejects), both micro-batches seeing the policy before the step
    log_probs, mask = _reference_log_probs(base_model, data), data.batch["response_mask"]
    log_ratio = log_probs - data.batch["old_log_probs"].double()
    k3 = (log_ratio.exp() - 1 - log_ratio)[mask.bool()]
    assert float((k3 - 0.02).abs().min()) > 1e-4, "precondition: no token's k3 sits on the threshold"
    kept = torch.tensor(rejection(log_ratio, mask, [("token_k3", "0.02")])[0])
    assert 0 < kept.sum() < mask.sum()
    expected_loss = _token_mean_loss(log_probs, data, kept, denominator=float(mask.sum()), high=0.28)
    assert metrics["actor/pg_loss"][0] == pytest.approx(expected_loss, rel=1e-5)
    assert _token_mean_loss(log_probs, data, kept, high=0.28) != pytest.approx(expected_loss, rel=1e-2), \
        "normalised by the kept tokens: another loss"


def test_unknown_loss_mode_is_an_error(base_model):
    with pytest.raises(ValueError, match="unknown policy loss 'nope'"):
        _actor(base_model, policy_loss={"loss_mode": "nope"})
