"""Rollout/training mismatch: how far the rollout engine's sampled-token log-probs are from the actor's."""

from __future__ import annotations

import torch

from verl.utils.torch_functional import masked_mean


def logprob_mismatch_metrics(rollout_log_probs: torch.Tensor, actor_log_probs: torch.Tensor,
                             response_mask: torch.Tensor) -> dict[str, float]:
    """Over the tokens of ``response_mask``: mean and max |actor - rollout| log-prob, mean |p_actor - p_rollout|
    (veRL's rollout_probs_diff) and the k3 estimate of KL(rollout || actor). Empty without such tokens."""
    mask = response_mask.bool()
    if not mask.any():
        return {}
    diff = actor_log_probs.float() - rollout_log_probs.float()
    abs_diff = diff.abs()
    return {
        "rollout/logprob_abs_diff_mean": float(masked_mean(abs_diff, mask.float())),
        "rollout/logprob_abs_diff_max": float(abs_diff[mask].max()),
        "rollout/probs_abs_diff_mean": float(masked_mean((diff.exp() - 1).abs() * rollout_log_probs.float().exp(),
                                                         mask.float())),
        "rollout/kl_k3": float(masked_mean(diff.exp() - 1 - diff, mask.float())),
    }
