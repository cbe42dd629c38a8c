"""The REINFORCE and bypass-mode policy losses of rollout correction against float64 loops, on dialogue-shaped
inputs (user turns masked in the middle of rows, a row without a loss token)."""
import math

import pytest
import torch
from tests.helpers.rollout_corr_reference import assert_metrics_match, dialogue_batch, rejection, weights

from verl.trainer.ppo import core_algos
from verl.utils.agent_turns import agent_turn_ids_from_mask


def _inputs(seed: int):
    rollout_lp, current, mask = dialogue_batch(seed, masked_value=0.0)
    gen = torch.Generator().manual_seed(seed + 100)
    advantages = torch.randn(mask.shape, generator=gen, dtype=torch.float64) * mask
    return current.clone().requires_grad_(True), rollout_lp, advantages, mask


def _token_mean(values: list[list[float]], mask) -> float:
    cells = [v for row, m in zip(values, mask.tolist()) for v, k in zip(row, m) if k]
    return sum(cells) / len(cells)


def _config(**corr) -> dict:
    return {"clip_ratio": 0.2, "clip_ratio_c": 3.0, "policy_loss": {"loss_mode": "bypass_mode",
                                                                      "rollout_correction": corr}}


def test_reinforce_loss_and_gradient_match_a_float64_loop():
    log_prob, rollout_lp, adv, mask = _inputs(0)
    w = torch.rand(mask.shape, dtype=torch.float64) + 0.5
    loss, metrics = core_algos.compute_policy_loss_reinforce(rollout_lp, log_prob, adv, mask, "token-mean", None, w)
    lp, a, ww = log_prob.tolist(), adv.tolist(), w.tolist()
    expected = _token_mean([[-a[i][t] * lp[i][t] * ww[i][t] for t in range(len(lp[0]))] for i in range(len(lp))], mask)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    n = float(mask.sum())
    assert torch.allclose(log_prob.grad, -adv * w * mask / n)
    assert float(metrics["actor/ppo_kl"]) == pytest.approx(_token_mean((rollout_lp - log_prob).tolist(), mask))
    seq_loss, _ = core_algos.compute_policy_loss_reinforce(rollout_lp, log_prob, adv, mask, "seq-mean-token-mean")
    rows = [[-a[i][t] * lp[i][t] for t in range(len(lp[0])) if mask[i, t]] for i in range(len(lp))]
    rows = [sum(r) / len(r) for r in rows if r]
    assert seq_loss.item() == pytest.approx(sum(rows) / len(rows), rel=1e-12)


def _dual_clip_ppo(log_prob: float, old: float, a: float, low: float = 0.2, high: float = 0.2, c: float = 3.0) -> float:
    """One token's dual-clip PPO loss, float64 (ratio of the clamped log-ratio)."""
    ratio = math.exp(max(-20.0, min(20.0, log_prob - old)))
    loss = max(-a * ratio, -a * min(max(ratio, 1 - low), 1 + high))
    return min(loss, -a * c) if a < 0 else loss


def _bypass_ppo_reference(log_prob, rollout_lp, adv, kept, mode: str, sampled_mask) -> float:
    """The bypass PPO-clip loss, float64: the kept tokens' losses over the actor's pre-rejection counts (tokens
    or non-empty rows of the sampled mask), the ratio taken against the rollout's log-probs."""
    lp, old, a = log_prob.tolist(), rollout_lp.tolist(), adv.tolist()
    rows = [[_dual_clip_ppo(lp[i][t], old[i][t], a[i][t]) for t in range(len(lp[0])) if kept[i][t]]
            for i in range(len(lp))]
    sampled = sampled_mask.tolist()
    if mode == "token-mean":
        return math.fsum(x for row in rows for x in row) / sum(map(sum, sampled))
    row_means = [math.fsum(row) / len(row) for row in rows if row]  # seq-mean-token-mean
    return math.fsum(row_means) / sum(1 for row in sampled if any(row))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_bypass_ppo_clip_loss_is_over_the_actors_pre_rejection_counts(mode):
    log_prob, rollout_lp, adv, mask = _inputs(1)
    log_prob = log_prob.detach().clone().requires_grad_(True)
    with torch.no_grad():  # rows 4-5 far off the rollout: sequences that rejection drops whole under seq options
        log_prob[4:6] += 0.4 * mask[4:6]
    cfg = _config(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="turn_mean_k3", rollout_rs_threshold=0.02,
                  loss_type="ppo_clip")
    sampled_tokens, sampled_rows = float(mask.sum()), float((mask.sum(-1) > 0).sum())
    cfg["global_batch_info"] = {"dp_size": 1, "batch_num_tokens": sampled_tokens, "global_batch_size": sampled_rows}
    loss, metrics = core_algos.compute_policy_loss_bypass_mode(rollout_lp, log_prob, adv, mask, mode, cfg)
    log_ratio = (log_prob - rollout_lp).detach()
    kept, rs_expected = rejection(log_ratio, mask, [("turn_mean_k3", "0.02")])
    assert 0 < sum(map(sum, kept)) < mask.sum(), "the inputs should reject some turns and keep others"
    assert sum(1 for row in kept if any(row)) < sampled_rows, "and some whole rows"
    expected = _bypass_ppo_reference(log_prob.detach(), rollout_lp, adv, kept, mode, mask)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    # a loss normalised by what rejection kept (tokens or rows) is another loss, which this test tells apart
    kept_only = _bypass_ppo_reference(log_prob.detach(), rollout_lp, adv, kept, mode, torch.tensor(kept))
    assert kept_only != pytest.approx(expected, rel=1e-3)
    _, is_expected = weights(log_ratio, mask, "token", 2.0)
    for key, value in {**is_expected, **rs_expected}.items():
        assert float(metrics[f"rollout_corr/{key}"]) == pytest.approx(value, rel=1e-7, abs=1e-9), key
    kept_tokens = [(i, t) for i, row in enumerate(kept) for t, k in enumerate(row) if k]
    assert float(metrics["actor/ppo_kl"]) == pytest.approx(
        math.fsum(-float(log_ratio[i, t]) for i, t in kept_tokens) / len(kept_tokens), rel=1e-9)


@pytest.mark.parametrize("level", ["token", "turn", "sequence"])
def test_bypass_reinforce_applies_current_over_rollout_weights(level):
    log_prob, rollout_lp, adv, mask = _inputs(2)
    ids = agent_turn_ids_from_mask(mask)
    cfg = _config(rollout_is=level, rollout_is_threshold="0.5_3.0", rollout_is_batch_normalize=True,
                  loss_type="reinforce")
    loss, metrics = core_algos.compute_policy_loss_bypass_mode(rollout_lp, log_prob, adv, mask, "token-mean", cfg,
                                                               torch.full_like(mask, 99.0), turn_ids=ids)
    w, expected_metrics = weights((log_prob - rollout_lp).detach(), mask, level, 3.0, 0.5, normalize=True)
    lp, a = log_prob.tolist(), adv.tolist()
    expected = _token_mean([[-a[i][t] * lp[i][t] * w[i][t] for t in range(len(lp[0]))] for i in range(len(lp))], mask)
    assert loss.item() == pytest.approx(expected, rel=1e-10)
    assert_metrics_match({k.removeprefix("rollout_corr/"): float(v) for k, v in metrics.items()
                          if k.startswith("rollout_corr/rollout_is")}, expected_metrics)
    loss.backward()  # the weights carry no gradient
    assert torch.allclose(log_prob.grad, -adv * torch.tensor(w, dtype=torch.float64) * mask / float(mask.sum()))


def test_bypass_loss_errors_and_padding_only_micro_batches():
    log_prob, rollout_lp, adv, mask = _inputs(3)
    with pytest.raises(ValueError, match="policy_loss.rollout_correction"):
        core_algos.compute_policy_loss_bypass_mode(rollout_lp, log_prob, adv, mask, "token-mean", {"clip_ratio": 0.2})
    with pytest.raises(ValueError, match="ppo_clip or reinforce"):
        core_algos.compute_policy_loss_bypass_mode(rollout_lp, log_prob, adv, mask, "token-mean",
                                                   _config(loss_type="dpo"))
    empty = torch.zeros_like(mask)
    loss, metrics = core_algos.compute_policy_loss_bypass_mode(rollout_lp, log_prob, adv, empty, "token-mean",
                                                               _config(rollout_is="token", rollout_rs="token_k3",
                                                                       rollout_rs_threshold=0.1))
    assert loss.item() == 0.0 and not any(k.startswith("rollout_corr/") for k in metrics)
    assert core_algos.get_policy_loss_fn("bypass_mode") is core_algos.compute_policy_loss_bypass_mode
