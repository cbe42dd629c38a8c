"""Vectorized GRPO and RLOO outcome advantages (veRL's ``grpo_vectorized`` / ``rloo_vectorized`` estimators).

Same results as :func:`~verl.trainer.ppo.advantages.compute_grpo_outcome_advantage` and
:func:`~verl.trainer.ppo.advantages.compute_rloo_outcome_advantage` (group of one included), with the per-group
statistics computed by scatter-adds over group ids instead of a Python loop over groups. Registered with
:func:`verl.trainer.ppo.advantages.register_adv_est`; re-exported by :mod:`verl.trainer.ppo.core_algos`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch

from verl.trainer.ppo._checks import _check_same_shape
from verl.trainer.ppo.advantages import AdvantageEstimator, register_adv_est

__all__ = ["compute_grpo_vectorized_outcome_advantage", "compute_rloo_vectorized_outcome_advantage", "group_ids"]


def group_ids(index: Sequence[Hashable] | np.ndarray | torch.Tensor, batch_size: int, device: torch.device) -> torch.Tensor:
    """Dense group numbers 0..G-1 (int64 tensor on ``device``) for the per-row group labels ``index``."""
    labels = index.tolist() if isinstance(index, (torch.Tensor, np.ndarray)) else list(index)
    if len(labels) != batch_size:
        raise ValueError(f"index has {len(labels)} entries but the batch has {batch_size} rows")
    numbers: dict[Hashable, int] = {}
    dense = [numbers.setdefault(label, len(numbers)) for label in labels]
    return torch.tensor(dense, dtype=torch.int64, device=device)


def _group_sums(values: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Sum of ``values`` per group (length G), gathered back to one entry per row."""
    n_groups = int(groups.max().item()) + 1 if groups.numel() else 0
    sums = torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(0, groups, values)
    return sums[groups]


@register_adv_est(AdvantageEstimator.GRPO_VECTORIZED)
def compute_grpo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable] | np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage, vectorized: (score - group mean) / (unbiased group std + epsilon), or score -
    group mean without ``norm_adv_by_std_in_grpo``; a group of one uses mean 0 and std 1. Broadcast over the
    loss-carrying tokens. Returns ``(advantages, advantages)``."""
    _check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        groups = group_ids(index, scores.shape[0], scores.device)
        counts = _group_sums(torch.ones_like(scores), groups)
        single = counts == 1
        mean = torch.where(single, torch.zeros_like(scores), _group_sums(scores, groups) / counts)
        squares = _group_sums((scores - mean) ** 2, groups)
        std = torch.where(single, torch.ones_like(scores), torch.sqrt(squares / (counts - 1).clamp(min=1)))
        centred = scores - mean
        advantages = centred / (std + epsilon) if norm_adv_by_std_in_grpo else centred
        advantages = advantages.unsqueeze(-1) * response_mask.to(advantages.dtype)
    return advantages, advantages


@register_adv_est(AdvantageEstimator.RLOO_VECTORIZED)
def compute_rloo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable] | np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO outcome advantage, vectorized: score minus the mean score of the other rows of its group, i.e.
    (score - group mean) * n / (n - 1); a group of one keeps its raw score. Returns ``(advantages, advantages)``."""
    _check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        groups = group_ids(index, scores.shape[0], scores.device)
        counts = _group_sums(torch.ones_like(scores), groups)
        mean = _group_sums(scores, groups) / counts
        leave_one_out = (scores - mean) * counts / (counts - 1).clamp(min=1)
        advantages = torch.where(counts > 1, leave_one_out, scores)
        advantages = advantages.unsqueeze(-1) * response_mask.to(advantages.dtype)
    return advantages, advantages
