"""k3 = exp(l) - 1 - l is >= 0 in exact arithmetic, and every metric built from it is too (no float noise shown raw).

The fixture's log-ratios are tiny and positive (1e-8 .. 5e-8) in float32: exp(l) rounds to exactly 1.0 there, so
the formula exp(l) - 1 - l gives -l < 0 on any IEEE machine; the clamped expm1 form gives 0 <= k3 <= its float64
value (l^2/2 ~ 1e-15) plus float noise.
"""
from __future__ import annotations

import torch

from verl.trainer.ppo.rollout_corr_helper import compute_offpolicy_metrics, compute_rollout_rejection_mask
from verl.workers.rollout.logprob_mismatch import logprob_mismatch_by_turn, logprob_mismatch_metrics


def _tiny_gap(rows: int = 4, width: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    rollout = -torch.rand(rows, width, generator=generator, dtype=torch.float64) * 1e-3  # near 0: fine resolution
    gap = 1e-8 + 4e-8 * torch.rand(rows, width, generator=generator, dtype=torch.float64)
    old = (rollout + gap).float()
    rollout = rollout.float()
    mask = torch.ones(rows, width)
    mask[:, -5:] = 0
    return old, rollout, mask


def test_k3_divergence_is_nonnegative_and_exact_to_float_precision():
    from verl.utils.torch_functional import k3_divergence

    l64 = torch.cat([torch.linspace(-1e-7, 1e-7, 2001, dtype=torch.float64),
                     torch.linspace(-3.0, 3.0, 601, dtype=torch.float64)])
    exact = torch.expm1(l64) - l64  # float64 reference
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert bool((k3_divergence(l64.to(dtype)) >= 0).all()), dtype
    l32 = l64.float()
    exact_at_input = torch.expm1(l32.double()) - l32.double()
    assert torch.allclose(k3_divergence(l32).double(), exact_at_input, rtol=1e-5, atol=1e-7)
    assert torch.allclose(k3_divergence(l64), exact.clamp(min=0.0))


def test_k3_metrics_never_print_negative():
    old, rollout, mask = _tiny_gap()
    assert bool(((old - rollout).exp() - 1 - (old - rollout))[mask.bool()].lt(0).any())  # the fixture's point
    metrics = compute_offpolicy_metrics(old, rollout, mask)
    assert 0.0 <= metrics["k3_kl"] < 1e-12
    _, rejection = compute_rollout_rejection_mask(old - rollout, mask, "token_k3", 0.01)
    assert 0.0 <= rejection["rollout_rs_token_k3_min"] <= rejection["rollout_rs_token_k3_mean"] < 1e-12
    mismatch = logprob_mismatch_metrics(rollout, old, mask)
    assert 0.0 <= mismatch["rollout/kl_k3"] < 1e-12
    turns = torch.where(mask.bool(), torch.arange(64).expand(4, 64) // 16, torch.full((4, 64), -1))
    by_turn = logprob_mismatch_by_turn(rollout, old, turns)
    assert by_turn and all(v >= 0 for k, v in by_turn.items() if "kl_k3" in k)
