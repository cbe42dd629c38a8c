"""Rollout/training mismatch: how far the rollout engine's sampled-token log-probs are from the actor's."""

from __future__ import annotations

import torch

from verl.utils.torch_functional import k3_divergence, masked_mean


def logprob_mismatch_metrics(rollout_log_probs: torch.Tensor, actor_log_probs: torch.Tensor,
                             response_mask: torch.Tensor) -> dict[str, float]:
    """Over the tokens of ``response_mask``: mean and max |actor - rollout| log-prob, mean |p_actor - p_rollout|
    (veRL's rollout_probs_diff) and the k3 estimate of KL(rollout || actor) (>= 0: each token's clamped at 0). Empty
    without such tokens."""
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
        "rollout/kl_k3": float(masked_mean(k3_divergence(diff), mask.float())),
    }


def logprob_mismatch_by_turn(rollout_log_probs: torch.Tensor, actor_log_probs: torch.Tensor,
                             turn_ids: torch.Tensor, max_turns: int = 8) -> dict[str, float]:
    """The mismatch per agent-turn index, to see whether it grows along a dialogue: ``rollout/kl_k3_turn_{k}`` and
    ``rollout/logprob_abs_diff_mean_turn_{k}`` over the tokens of every row's turn k (``turn_ids`` (bs, R), -1
    outside the agent's tokens) for k < ``max_turns``, and ``..._turn_{max_turns}plus`` over the later turns.
    Empty unless some row has a second turn; turn indices without tokens are left out."""
    inside = turn_ids >= 0
    if not bool((turn_ids >= 1).any()):
        return {}
    diff = torch.where(inside, actor_log_probs.double() - rollout_log_probs.double(), torch.zeros((), dtype=torch.float64))
    bins = torch.where(inside, turn_ids.clamp(max=max_turns), torch.full_like(turn_ids, max_turns + 1)).flatten()
    per_bin = torch.zeros(3, max_turns + 2, dtype=torch.float64)
    rows = torch.stack([torch.ones_like(diff), k3_divergence(diff), diff.abs()]).flatten(1)
    per_bin.scatter_add_(1, bins.expand(3, -1), rows)
    metrics: dict[str, float] = {}
    for k, (count, k3, abs_diff) in enumerate(per_bin[:, :max_turns + 1].T.tolist()):
        if count:
            name = f"turn_{k}" if k < max_turns else f"turn_{max_turns}plus"
            metrics[f"rollout/kl_k3_{name}"] = k3 / count
            metrics[f"rollout/logprob_abs_diff_mean_{name}"] = abs_diff / count
    return metrics
