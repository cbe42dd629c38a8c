"""In-process tests of DataParallelPPOActor on the tiny model (no torch.distributed)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from verl.protocol import DP_PAD_ROWS_KEY
from verl.utils.optim import build_optimizer
from verl.workers.actor.dp_actor import DataParallelPPOActor

from tests.helpers.ppo_batch_helpers import RESPONSE_LEN, actor_config, make_ppo_batch

pytestmark = pytest.mark.oldest  # also run under the lowest declared transformers (.venv-vllm)


@pytest.fixture(scope="module")
def base_model(tiny_model_path):
    """The tiny causal LM in fp32, eval-free (no dropout in Qwen2)."""
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)


def _actor(base_model, sgd: bool = False, **overrides) -> DataParallelPPOActor:
    """A fresh actor on a private copy of the model, with AdamW (or plain SGD, whose step is lr * gradient)."""
    cfg = actor_config(**overrides)
    module = copy.deepcopy(base_model)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1) if sgd else build_optimizer(module.parameters(), cfg.optim)
    return DataParallelPPOActor(cfg, module, optimizer)


def _params(actor: DataParallelPPOActor) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in actor.actor_module.named_parameters()}


def test_compute_log_prob_matches_manual_log_softmax(base_model):
    actor = _actor(base_model)
    data = make_ppo_batch(5, base_model.config.vocab_size)
    data.meta_info.update(micro_batch_size=2, temperature=0.7)
    log_probs, entropy = actor.compute_log_prob(data, calculate_entropy=True)
    batch = data.batch
    with torch.no_grad():
        logits = base_model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits
    logits = logits[:, -RESPONSE_LEN - 1 : -1] / 0.7
    expected = torch.log_softmax(logits, -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    probs = torch.softmax(logits, -1)
    expected_entropy = -(probs * torch.log_softmax(logits, -1)).sum(-1)
    assert log_probs.shape == (5, RESPONSE_LEN)
    torch.testing.assert_close(log_probs, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, expected_entropy, atol=1e-5, rtol=1e-5)


def test_update_policy_changes_weights_and_reports_metrics(base_model):
    actor = _actor(base_model)
    data = make_ppo_batch(8, base_model.config.vocab_size)
    data.meta_info["micro_batch_size"] = 4
    data.batch["old_log_probs"] = actor.compute_log_prob(data)[0]
    before = _params(actor)
    metrics = actor.update_policy(data)
    after = _params(actor)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # two mini-batches of 4 rows, two micro-batches each
    assert len(metrics["actor/pg_loss"]) == 2 and len(metrics["actor/grad_norm"]) == 2
    assert len(metrics["actor/pg_clipfrac"]) == 4
    # the first micro-batch sees the weights that produced old_log_probs: ratio 1, nothing clipped
    assert metrics["actor/ppo_kl"][0] == pytest.approx(0.0, abs=1e-6)
    assert metrics["actor/pg_clipfrac"][0] == 0.0
    assert all(math.isfinite(v) and v > 0 for v in metrics["actor/grad_norm"])
    assert metrics["actor/grad_norm_nonfinite"] == [0.0, 0.0]
    assert metrics["actor/kl_loss"][0] > 0 and metrics["actor/entropy"][0] > 0


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                           "seq-mean-token-sum-norm"])
def test_update_is_invariant_to_micro_batch_split(base_model, loss_agg_mode):
    """One mini-batch of 6 rows: 1 x 6, 2 x 3 and 6 x 1 micro-batches give the same gradient step (SGD, so
    the parameter change is the clipped gradient itself, not Adam's sign-like normalised step)."""
    data = make_ppo_batch(6, base_model.config.vocab_size, seed=3)
    results = []
    for micro in (6, 3, 1):
        actor = _actor(
            base_model, sgd=True, ppo_mini_batch_size=6, ppo_micro_batch_size_per_gpu=micro, loss_agg_mode=loss_agg_mode
        )
        metrics = actor.update_policy(data)
        results.append((_params(actor), metrics["actor/pg_loss"][0], metrics["actor/grad_norm"][0]))
    ref_params, ref_loss, ref_norm = results[0]
    for params, loss, norm in results[1:]:
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
        assert norm == pytest.approx(ref_norm, rel=1e-5)
        for name in ref_params:
            torch.testing.assert_close(params[name], ref_params[name], atol=1e-6, rtol=1e-5)


def test_nonfinite_gradient_skips_the_step(base_model):
    actor = _actor(base_model, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4)
    data = make_ppo_batch(4, base_model.config.vocab_size)
    data.batch["advantages"][0, 0] = float("nan")  # injected fault
    before = _params(actor)
    metrics = actor.update_policy(data)
    assert metrics["actor/grad_norm_nonfinite"] == [1.0]
    assert not math.isfinite(metrics["actor/grad_norm"][0])
    for name, value in _params(actor).items():
        assert torch.equal(value, before[name])
    assert all(p.grad is None for p in actor.actor_module.parameters())


def test_update_rejects_bad_batches(base_model):
    actor = _actor(base_model, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2)
    data = make_ppo_batch(6, base_model.config.vocab_size)
    with pytest.raises(ValueError, match="not divisible by ppo_mini_batch_size"):
        actor.update_policy(data)
    data = make_ppo_batch(4, base_model.config.vocab_size)
    data.batch.pop("ref_log_prob")
    with pytest.raises(KeyError, match="ref_log_prob"):
        actor.update_policy(data)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        _actor(base_model, loss_agg_mode="mean")


def test_dp_padding_rows_carry_no_loss(base_model):
    """A rank whose chunk ends with a DP_COMPUTE_PROTO padding row (a copy of a row another rank trains on)
    updates exactly as if the row were absent: it adds nothing to the loss nor to the global token count."""
    data = make_ppo_batch(3, base_model.config.vocab_size, seed=11)
    padded = data.select_idxs([0, 1, 2, 0])
    padded.meta_info[DP_PAD_ROWS_KEY] = 1
    results = []
    for batch, rows in ((data, 3), (padded, 4)):
        actor = _actor(base_model, sgd=True, ppo_mini_batch_size=rows, ppo_micro_batch_size_per_gpu=rows)
        metrics = actor.update_policy(batch)
        results.append((_params(actor), metrics))
    (expected, expected_metrics), (got, got_metrics) = results
    for name in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert got_metrics[name][0] == pytest.approx(expected_metrics[name][0], rel=1e-5, abs=1e-7), name
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=1e-5)
    assert torch.equal(padded.batch["response_mask"][3], data.batch["response_mask"][0])  # input left untouched


@pytest.mark.parametrize("micro", [6, 3])
def test_dr_grpo_policy_loss_is_the_mean_sequence_token_sum_over_the_horizon(base_model, micro):
    """seq-mean-token-sum-norm at ratio 1 (old log-probs from the same weights): the per-token loss is -A, so
    the mini-batch pg_loss is the mean over sequences of sum(-A) / T (T = RESPONSE_LEN, or loss_scale_factor),
    computed here in float64 from the batch, whatever the micro-batch split."""
    data = make_ppo_batch(6, base_model.config.vocab_size, seed=5)
    data.batch["response_mask"][2] = 0  # an empty row: not a sequence of the mean
    adv, mask = data.batch["advantages"].double(), data.batch["response_mask"].double()
    row_sums = [float(-(a * m).sum()) for a, m in zip(adv, mask) if m.sum() > 0]
    expected = sum(row_sums) / len(row_sums) / RESPONSE_LEN
    for factor, want in ((None, expected), (4 * RESPONSE_LEN, expected / 4)):
        actor = _actor(base_model, sgd=True, ppo_mini_batch_size=6, ppo_micro_batch_size_per_gpu=micro,
                       loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=factor, entropy_coeff=0.0,
                       use_kl_loss=False)
        data.meta_info["micro_batch_size"] = 6
        data.batch["old_log_probs"], _ = actor.compute_log_prob(data)
        metrics = actor.update_policy(data)
        assert metrics["actor/pg_loss"][0] == pytest.approx(want, rel=1e-5, abs=1e-7)
