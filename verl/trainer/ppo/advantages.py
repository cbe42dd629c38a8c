"""Advantage estimators (GAE, GRPO, RLOO, REINFORCE++, REINFORCE++ with baseline, ReMax) and their registry.

The vectorized GRPO/RLOO live in :mod:`~verl.trainer.ppo.advantages_vectorized` and the turn-level estimators
for multi-turn rows (``turn_mixed``, ``turn_gae``) in :mod:`~verl.trainer.ppo.advantages_turn`; all are named in
:class:`AdvantageEstimator` and registered here.

Names, parameter orders and semantics follow veRL's ``verl.trainer.ppo.core_algos``, which is where veRL keeps
them; :mod:`verl.trainer.ppo.core_algos` re-exports everything here, so ``core_algos.AdvantageEstimator``,
``core_algos.get_adv_estimator_fn``, ``core_algos.compute_grpo_outcome_advantage`` etc. work as in veRL.
All tensors are (batch, response_length) unless stated; ``response_mask`` is 1 on tokens that carry loss
(the policy's own tokens) and 0 on padding and on user/observation tokens. Every estimator returns
``(advantages, returns)`` computed without gradients.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from enum import Enum
from typing import Any

import numpy as np
import torch

import verl.utils.torch_functional as verl_F
from verl.trainer.ppo._checks import _cfg_get, _check_same_shape, _registering_decorator

__all__ = [
    "ADV_ESTIMATOR_REGISTRY", "AdvantageEstimator", "compute_gae_advantage_return", "compute_grpo_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage", "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage", "compute_rloo_outcome_advantage", "get_adv_estimator_fn", "register_adv_est",
]  # fmt: skip


class AdvantageEstimator(str, Enum):
    """Names of the built-in advantage estimators (the values of ``algorithm.adv_estimator``)."""

    GAE = "gae"
    GRPO = "grpo"
    RLOO = "rloo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    REMAX = "remax"
    GRPO_VECTORIZED = "grpo_vectorized"
    RLOO_VECTORIZED = "rloo_vectorized"
    TURN_MIXED = "turn_mixed"
    TURN_GAE = "turn_gae"


ADV_ESTIMATOR_REGISTRY: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {}


def _registry_name(name_or_enum: str | Enum) -> str:
    """The registry key of a name or enum member."""
    return name_or_enum.value if isinstance(name_or_enum, Enum) else str(name_or_enum)


def register_adv_est(name_or_enum: str | AdvantageEstimator) -> Callable[[Callable], Callable]:
    """Decorator registering an advantage estimator under ``name_or_enum``.

    Registering a different function under a taken name raises ValueError.
    """
    return _registering_decorator(ADV_ESTIMATOR_REGISTRY, _registry_name(name_or_enum), "advantage estimator")


def get_adv_estimator_fn(name_or_enum: str | AdvantageEstimator) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """Return the advantage estimator registered as ``name_or_enum``; ValueError listing the known names if none."""
    name = _registry_name(name_or_enum)
    if name not in ADV_ESTIMATOR_REGISTRY:
        raise ValueError(f"Unknown advantage estimator simply: {name} (registered: {sorted(ADV_ESTIMATOR_REGISTRY)})")
    return ADV_ESTIMATOR_REGISTRY[name]


def _group_rows(index: Sequence[Hashable] | np.ndarray | torch.Tensor, batch_size: int) -> dict[Hashable, list[int]]:
    """Map each group id in ``index`` (one per row) to the list of its row numbers, in row order."""
    if isinstance(index, torch.Tensor):  # 0-d tensors hash by identity: group by their values instead
        index = index.tolist()
    if len(index) != batch_size:
        raise ValueError(f"index has {len(index)} entries but the batch has {batch_size} rows")
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for row, group_id in enumerate(index):
        groups[group_id].append(row)
    return groups


# ----------------------------------------------------------------------------------------- advantage estimators


@register_adv_est(AdvantageEstimator.GAE)
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the response, skipping masked (user/observation) tokens.

    Scans right to left. At a masked position the running next-value and GAE accumulator are carried through
    unchanged, so the last agent token of one turn bootstraps from the first agent token of the next turn
    (rewards at masked positions are ignored). Returns ``(advantages, returns)`` with returns = raw advantages
    + values and advantages whitened over the masked tokens of the batch.
    """
    _check_same_shape(token_level_rewards=token_level_rewards, values=values, response_mask=response_mask)
    with torch.no_grad():
        mask = response_mask.to(values.dtype)
        next_value = torch.zeros_like(values[:, 0])
        last_gae = torch.zeros_like(values[:, 0])
        reversed_advantages = []
        for t in reversed(range(values.shape[1])):
            delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
            gae_here = delta + gamma * lam * last_gae
            next_value = mask[:, t] * values[:, t] + (1 - mask[:, t]) * next_value
            last_gae = mask[:, t] * gae_here + (1 - mask[:, t]) * last_gae
            reversed_advantages.append(last_gae)
        advantages = torch.stack(reversed_advantages[::-1], dim=1)
        returns = advantages + values
        advantages = verl_F.masked_whiten(advantages, mask)
    return advantages, returns


@register_adv_est(AdvantageEstimator.GRPO)
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable] | np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage: each row's score (sum of its rewards) relative to its group (rows sharing ``index``).

    (score - group mean) / (group std + epsilon) with the unbiased std, or score - group mean when
    ``norm_adv_by_std_in_grpo`` is False (Dr.GRPO). A group of one row uses mean 0 and std 1. The scalar is
    broadcast over the row's loss-carrying tokens. Returns ``(advantages, advantages)``.
    """
    _check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        advantages = torch.empty_like(scores)
        for rows in _group_rows(index, scores.shape[0]).values():
            group = scores[rows]
            if len(rows) == 1:
                mean, std = torch.zeros_like(group[0]), torch.ones_like(group[0])
            else:
                mean, std = group.mean(), group.std(unbiased=True)
            centred = group - mean
            advantages[rows] = centred / (std + epsilon) if norm_adv_by_std_in_grpo else centred
        advantages = advantages.unsqueeze(-1) * response_mask.to(advantages.dtype)
    return advantages, advantages


@register_adv_est(AdvantageEstimator.RLOO)
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable] | np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO outcome advantage: a row's score minus the mean score of the other rows of its group.

    Computed as (score - group mean) * n / (n - 1) for a group of n > 1 rows; a group of one keeps its raw
    score. Broadcast over the loss-carrying tokens. Returns ``(advantages, advantages)``.
    """
    _check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        advantages = scores.clone()
        for rows in _group_rows(index, scores.shape[0]).values():
            n = len(rows)
            if n > 1:
                group = scores[rows]
                advantages[rows] = (group - group.mean()) * n / (n - 1)
        advantages = advantages.unsqueeze(-1) * response_mask.to(advantages.dtype)
    return advantages, advantages


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS)
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float | None = None,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ advantage: discounted return-to-go over the loss-carrying tokens, whitened over the batch.

    Scanning right to left, a loss-carrying token's return is its reward plus gamma times the running return;
    a masked token (a user/observation turn inside a dialogue, or right padding) adds no reward, is not
    discounted and carries the running return through unchanged, so an outcome reward at the last agent turn
    reaches the earlier agent turns (as veRL >= 0.9.0, whose GAE treats masked tokens the same way). Returns are
    0 at masked tokens. ``gamma`` falls back to ``config.gamma`` (veRL passes the algorithm config). Returns
    ``(masked_whiten(returns) * mask, returns)``.
    """
    _check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    if gamma is None:
        gamma = _cfg_get(config, "gamma")
        if gamma is None:
            raise ValueError("compute_reinforce_plus_plus_outcome_advantage needs gamma (or config.gamma)")
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)
        returns = torch.zeros_like(token_level_rewards)
        running = torch.zeros_like(token_level_rewards[:, 0])
        for t in reversed(range(token_level_rewards.shape[1])):
            here = token_level_rewards[:, t] + gamma * running
            returns[:, t] = torch.where(mask[:, t] > 0, here, torch.zeros_like(here))
            running = torch.where(mask[:, t] > 0, here, running)
        advantages = verl_F.masked_whiten(returns, mask) * mask
    return advantages, returns


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE)
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable] | np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline: score minus its group's mean (0 for a group of one), broadcast over
    the loss-carrying tokens, then whitened over the batch. Returns ``(advantages, advantages)``."""
    _check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)
        scores = token_level_rewards.sum(dim=-1)
        centred = scores.clone()
        for rows in _group_rows(index, scores.shape[0]).values():
            if len(rows) > 1:
                centred[rows] = scores[rows] - scores[rows].mean()
        advantages = centred.unsqueeze(-1) * mask
        advantages = verl_F.masked_whiten(advantages, mask) * mask
    return advantages, advantages


@register_adv_est(AdvantageEstimator.REMAX)
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax advantage: masked return-to-go minus the per-row baseline (the greedy rollout's reward,
    ``reward_baselines`` of shape (bs,)) on loss-carrying tokens. Returns ``(advantages, returns)``."""
    _check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    if tuple(reward_baselines.shape) != (token_level_rewards.shape[0],):
        raise ValueError(
            f"reward_baselines must have shape ({token_level_rewards.shape[0]},), got {tuple(reward_baselines.shape)}"
        )
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)
        returns = (token_level_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        advantages = returns - reward_baselines.unsqueeze(-1) * mask
    return advantages, returns
