"""Padding-free (use_remove_padding) and token-budget (use_dynamic_bsz) paths of the actor and the critic give
the padded, fixed-size path's log-probs, entropies, values, losses and gradient steps, on random mixed-length
batches with user-turn masks (float32, tolerances stated per test)."""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

from verl.utils.fsdp_utils import enable_activation_checkpointing
from verl.workers.actor.dp_actor import DataParallelPPOActor
from verl.workers.critic.dp_critic import DataParallelPPOCritic

from tests.helpers.ppo_batch_helpers import actor_config, make_dialogue_batch

pytestmark = pytest.mark.oldest  # also run under the lowest declared transformers (.venv-vllm)

PROMPT, RESPONSE, ROWS = 12, 24, 8
LOSS_AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
# Packed and padded forwards add the same numbers in a different order: log-probs agree to ~1e-6.
ATOL, RTOL = 1e-5, 1e-5


@pytest.fixture(scope="module")
def base_model(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)


@pytest.fixture(scope="module")
def value_model(tiny_model_path):
    config = AutoConfig.from_pretrained(tiny_model_path)
    config.num_labels, config.classifier_dropout = 1, 0.0
    torch.manual_seed(0)
    return AutoModelForTokenClassification.from_pretrained(tiny_model_path, config=config, dtype=torch.float32)


@pytest.fixture(scope="module")
def batch(base_model):
    return make_dialogue_batch(ROWS, base_model.config.vocab_size, PROMPT, RESPONSE, seed=7)


def _actor(base_model, packed: bool, dynamic: bool = False, checkpointing: bool = False, **overrides):
    """An actor with plain SGD (its step is lr * the clipped gradient) on a private copy of the model."""
    settings = {"ppo_mini_batch_size": ROWS, "ppo_micro_batch_size_per_gpu": 2, "use_remove_padding": packed,
                "use_dynamic_bsz": dynamic, "ppo_max_token_len_per_gpu": 70, "grad_clip": 100.0}
    cfg = actor_config(**{**settings, **overrides})
    module = copy.deepcopy(base_model)
    if checkpointing:
        enable_activation_checkpointing(module)
    return DataParallelPPOActor(cfg, module, torch.optim.SGD(module.parameters(), lr=0.1))


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def _assert_same_step(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], base: dict[str, torch.Tensor]):
    """Same parameter change (SGD: the gradient), compared as deltas so the tolerance is on the step itself."""
    for name in expected:
        torch.testing.assert_close(got[name] - base[name], expected[name] - base[name], atol=1e-7, rtol=2e-4)


def _scored(data) -> torch.Tensor:
    """Response positions whose token and the token before it are attended."""
    mask = data.batch["attention_mask"].bool()
    return mask[:, PROMPT - 1 : -1] & mask[:, PROMPT:]


@pytest.mark.parametrize("dynamic", [False, True])
def test_packed_log_probs_and_entropy_match_padded(base_model, batch, dynamic):
    data = copy.copy(batch)
    data.meta_info = {"temperature": 0.7, "micro_batch_size": 3, "use_dynamic_bsz": dynamic, "max_token_len": 50}
    padded_lp, padded_ent = _actor(base_model, packed=False).compute_log_prob(data, calculate_entropy=True)
    packed_lp, packed_ent = _actor(base_model, packed=True).compute_log_prob(data, calculate_entropy=True)
    scored = _scored(data)
    assert scored.sum() > 80 and (data.batch["response_mask"].bool() & scored).sum() < scored.sum()  # user turns
    torch.testing.assert_close(packed_lp[scored], padded_lp[scored], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(packed_ent[scored], padded_ent[scored], atol=ATOL, rtol=RTOL)
    assert not packed_lp[~scored].any() and not packed_ent[~scored].any()


@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
def test_packed_and_dynamic_updates_match_padded_fixed(base_model, batch, loss_agg_mode):
    """Four paths, one step: padded+fixed (reference), packed+fixed, padded+dynamic, packed+dynamic; the
    dynamic split has a different number of micro-batches of unequal row counts."""
    start = _params(base_model)
    results = {}
    for packed in (False, True):
        for dynamic in (False, True):
            actor = _actor(base_model, packed, dynamic, loss_agg_mode=loss_agg_mode)
            metrics = actor.update_policy(batch)
            results[packed, dynamic] = (_params(actor.actor_module), metrics)
    expected, expected_metrics = results[False, False]
    assert len(expected_metrics["actor/pg_clipfrac"]) == ROWS // 2
    assert len(results[True, True][1]["actor/pg_clipfrac"]) != ROWS // 2
    for key, (params, metrics) in results.items():
        for name in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"):
            assert metrics[name][0] == pytest.approx(expected_metrics[name][0], rel=1e-5, abs=1e-7), (key, name)
        _assert_same_step(params, expected, start)


def test_gradient_checkpointing_composes_with_packing_and_token_budgets(base_model, batch):
    start = _params(base_model)
    plain = _actor(base_model, packed=False)
    plain.update_policy(batch)
    both = _actor(base_model, packed=True, dynamic=True, checkpointing=True, loss_agg_mode="token-mean")
    assert any(getattr(m, "gradient_checkpointing", False) for m in both.actor_module.modules())
    both.update_policy(batch)
    _assert_same_step(_params(both.actor_module), _params(plain.actor_module), start)


def _critic(value_model, packed: bool, dynamic: bool, loss_agg_mode: str = "token-mean") -> DataParallelPPOCritic:
    cfg = OmegaConf.create(
        {"ppo_mini_batch_size": ROWS, "ppo_micro_batch_size_per_gpu": 2, "ppo_epochs": 1, "shuffle": False,
         "cliprange_value": 0.2, "loss_agg_mode": loss_agg_mode, "grad_clip": 100.0, "use_remove_padding": packed,
         "use_dynamic_bsz": dynamic, "ppo_max_token_len_per_gpu": 70}
    )  # fmt: skip
    module = copy.deepcopy(value_model)
    return DataParallelPPOCritic(cfg, module, torch.optim.SGD(module.parameters(), lr=0.1))


def test_packed_values_match_padded(value_model, batch):
    data = copy.copy(batch)
    data.meta_info = {"micro_batch_size": 3}
    padded = _critic(value_model, packed=False, dynamic=False).compute_values(data)
    data.meta_info = {"use_dynamic_bsz": True, "max_token_len": 45}
    packed = _critic(value_model, packed=True, dynamic=True).compute_values(data)
    assert padded.abs().sum() > 0
    torch.testing.assert_close(packed, padded, atol=ATOL, rtol=RTOL)  # both zero outside response_mask


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-sum-norm"])
def test_packed_dynamic_critic_update_matches_padded_fixed(value_model, batch, loss_agg_mode):
    start = _params(value_model)
    reference = _critic(value_model, packed=False, dynamic=False, loss_agg_mode=loss_agg_mode)
    expected_metrics = reference.update_critic(batch)
    candidate = _critic(value_model, packed=True, dynamic=True, loss_agg_mode=loss_agg_mode)
    metrics = candidate.update_critic(batch)
    assert len(metrics["critic/vf_clipfrac"]) != len(expected_metrics["critic/vf_clipfrac"])
    assert metrics["critic/vf_loss"][0] == pytest.approx(expected_metrics["critic/vf_loss"][0], rel=1e-5)
    _assert_same_step(_params(candidate.critic_module), _params(reference.critic_module), start)


def test_dynamic_update_rejects_a_budget_below_the_longest_row(base_model, batch):
    actor = _actor(base_model, packed=True, dynamic=True, ppo_max_token_len_per_gpu=20)
    with pytest.raises(ValueError, match="ppo_max_token_len_per_gpu=20 is smaller than the longest row"):
        actor.update_policy(batch)
