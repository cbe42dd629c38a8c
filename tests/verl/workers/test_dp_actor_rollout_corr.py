"""DataParallelPPOActor with rollout correction (in process, tiny model): batch ``rollout_is_weights`` reach the
loss, and ``policy_loss.loss_mode=bypass_mode`` corrects against the rollout's log-probs it gets as old ones."""
from __future__ import annotations

import copy

import pytest
import torch
from tests.helpers.ppo_batch_helpers import actor_config, make_ppo_batch
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


def test_rollout_is_weights_multiply_the_token_losses(base_model):
    data = make_ppo_batch(8, base_model.config.vocab_size, seed=5)
    plain = _actor(base_model).update_policy(copy.deepcopy(data))
    data.batch["rollout_is_weights"] = torch.full_like(data.batch["advantages"], 2.5)
    weighted = _actor(base_model).update_policy(data)
    assert weighted["actor/pg_loss"][0] == pytest.approx(2.5 * plain["actor/pg_loss"][0], rel=1e-5)


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
    metrics = actor.update_policy(data)
    first = slice(0, 4)  # the first micro-batch sees the weights that computed `current`
    expected = compute_offpolicy_metrics(current[first], data.batch["old_log_probs"][first],
                                         data.batch["response_mask"][first])
    assert metrics["rollout_corr/kl"][0] == pytest.approx(expected["kl"], rel=1e-4)
    assert metrics["rollout_corr/k3_kl"][0] == pytest.approx(expected["k3_kl"], rel=1e-4)
    assert 0 < metrics["rollout_corr/rollout_rs_masked_fraction"][0] < 1
    assert len(metrics["rollout_corr/rollout_is_mean"]) == 2  # one value per micro-batch


def test_unknown_loss_mode_is_an_error(base_model):
    with pytest.raises(ValueError, match="unknown policy loss 'nope'"):
        _actor(base_model, policy_loss={"loss_mode": "nope"})
