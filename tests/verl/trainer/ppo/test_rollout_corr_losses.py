"""The REINFORCE and bypass-mode policy losses of rollout correction against float64 loops, on dialogue-shaped
inputs (user turns masked in the middle of rows, a row without a loss token)."""
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


def test_bypass_ppo_clip_is_vanilla_ppo_on_the_rejection_mask_without_weights():
    log_prob, rollout_lp, adv, mask = _inputs(1)
    cfg = _config(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="turn_mean_k3", rollout_rs_threshold=0.02,
                  loss_type="ppo_clip")
    loss, metrics = core_algos.compute_policy_loss_bypass_mode(rollout_lp, log_prob, adv, mask, "token-mean", cfg)
    log_ratio = (log_prob - rollout_lp).detach()
    kept, rs_expected = rejection(log_ratio, mask, [("turn_mean_k3", "0.02")])
    kept = torch.tensor(kept, dtype=mask.dtype)
    assert 0 < kept.sum() < mask.sum(), "the inputs should reject some turns and keep others"
    expected, expected_metrics = core_algos.compute_policy_loss_vanilla(rollout_lp, log_prob, adv, kept,
                                                                        "token-mean", cfg)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    _, is_expected = weights(log_ratio, mask, "token", 2.0)
    for key, value in {**is_expected, **rs_expected}.items():
        assert float(metrics[f"rollout_corr/{key}"]) == pytest.approx(value, rel=1e-7, abs=1e-9), key
    assert float(metrics["actor/ppo_kl"]) == pytest.approx(float(expected_metrics["actor/ppo_kl"]))


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
