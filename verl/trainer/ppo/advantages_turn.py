"""Turn-level advantage estimators for multi-turn rows (dialogues): ``turn_mixed`` and ``turn_gae``.

Both credit each agent turn as a whole: every token of a turn gets the same advantage, and tokens off the agent
turns (user turns, padding) get 0. Turns come from ``agent_turn_ids`` (the rollout loop's, else the runs of
``response_mask``; :mod:`verl.utils.agent_turns`); per-turn process rewards from ``turn_scores`` (bs, R), the sum
over a turn's tokens being that turn's reward (:mod:`verl.trainer.ppo.turn_layout`). Definitions, with their
parameters, are in docs/turn_level_credit.md. Registered with
:func:`verl.trainer.ppo.advantages.register_adv_est`; re-exported by :mod:`verl.trainer.ppo.core_algos`.
"""
from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any, Optional

import numpy as np
import torch

import verl.utils.torch_functional as verl_F
from verl.errors import ContractError
from verl.trainer.ppo._checks import _cfg_get, _check_same_shape
from verl.trainer.ppo.advantages import AdvantageEstimator, compute_grpo_outcome_advantage, register_adv_est
from verl.trainer.ppo.advantages_vectorized import group_ids
from verl.trainer.ppo.turn_layout import TURN_SCORES, TurnLayout, check_turn_ids, check_turn_scores
from verl.utils.agent_turns import agent_turn_ids_from_mask

__all__ = ["compute_turn_gae_advantage_return", "compute_turn_mixed_advantage", "normalise_turns_in_groups"]


def _layout(response_mask: torch.Tensor, agent_turn_ids: Optional[torch.Tensor]) -> TurnLayout:
    """The turn layout of the rows: ``agent_turn_ids`` when given (checked against the mask), else the mask's runs."""
    if agent_turn_ids is None:
        return TurnLayout.from_turn_ids(agent_turn_ids_from_mask(response_mask))
    check_turn_ids(agent_turn_ids, response_mask)
    return TurnLayout.from_turn_ids(agent_turn_ids)


def _config_number(value: Optional[float], config: Any, path: tuple[str, ...], name: str) -> float:
    """``value`` if given, else the config entry at ``path``; ValueError when neither is a finite number."""
    if value is None:
        node = config
        for key in path:
            node = _cfg_get(node, key)
        value = node
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number (or set config.{'.'.join(path)}), got {value!r}")
    return float(value)


def normalise_turns_in_groups(turn_rewards: torch.Tensor, present: torch.Tensor, groups: torch.Tensor,
                              epsilon: float = 1e-6, scale_by_std: bool = True) -> torch.Tensor:
    """(bs, K): each present turn's reward relative to all present turns of its row's group.

    ``groups`` (bs,) holds dense group numbers. The statistics of group g pool every present turn of every row in
    g: (r - mean) / (unbiased std + epsilon), or r - mean without ``scale_by_std``; a group with a single turn uses
    mean 0 and std 1 (GRPO's rule for a group of one). Absent turns get 0.
    """
    out = torch.zeros_like(turn_rewards)
    if not bool(present.any()):
        return out
    turn_groups = groups[:, None].expand_as(turn_rewards)[present]
    values = turn_rewards[present]
    num_groups = int(groups.max()) + 1
    counts = torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(
        0, turn_groups, torch.ones_like(values))
    sums = torch.zeros_like(counts).index_add_(0, turn_groups, values)
    single = counts <= 1
    mean = torch.where(single, torch.zeros_like(sums), sums / counts.clamp(min=1))
    squares = torch.zeros_like(counts).index_add_(0, turn_groups, (values - mean[turn_groups]) ** 2)
    std = torch.where(single, torch.ones_like(sums), torch.sqrt(squares / (counts - 1).clamp(min=1)))
    centred = values - mean[turn_groups]
    out[present] = centred / (std[turn_groups] + epsilon) if scale_by_std else centred
    return out


@register_adv_est(AdvantageEstimator.TURN_MIXED)
def compute_turn_mixed_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable] | np.ndarray,
    turn_scores: Optional[torch.Tensor],
    agent_turn_ids: Optional[torch.Tensor] = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    turn_weight: Optional[float] = None,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixed outcome + turn advantage (in the spirit of MAPO): A = A_outcome + turn_weight * A_turn on agent tokens.

    A_outcome is the GRPO advantage of the row's summed ``token_level_rewards`` within its group (``index``;
    see :func:`~verl.trainer.ppo.advantages.compute_grpo_outcome_advantage`). A_turn is the turn's process reward
    (the sum of ``turn_scores`` over the turn's tokens) normalised over all agent turns of all rows of the group
    (:func:`normalise_turns_in_groups`; mean-centred only when ``norm_adv_by_std_in_grpo`` is False), constant
    over the turn's tokens. ``turn_weight`` (>= 0) falls back to ``config.turn_mixed.turn_weight``; with 0 the
    result is GRPO's. ``turn_scores`` is required. Returns ``(advantages, advantages)``.
    """
    _check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    if turn_scores is None:
        raise ContractError(f"the turn_mixed estimator needs the per-turn rewards batch['{TURN_SCORES}'] (bs, R) from "
                            "the reward or rollout-loop plug-in (docs/turn_level_credit.md)")
    check_turn_scores(turn_scores, response_mask)
    beta = _config_number(turn_weight, config, ("turn_mixed", "turn_weight"), "turn_weight")
    if beta < 0:
        raise ValueError(f"turn_weight must be >= 0, got {beta}")
    with torch.no_grad():
        outcome, _ = compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=epsilon,
                                                    norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)
        layout = _layout(response_mask, agent_turn_ids)
        turn_rewards = layout.sum_per_turn(turn_scores.to(outcome.dtype))
        groups = group_ids(index, turn_rewards.shape[0], turn_rewards.device)
        turn_advantages = normalise_turns_in_groups(turn_rewards, layout.present, groups, epsilon,
                                                    scale_by_std=norm_adv_by_std_in_grpo)
        advantages = outcome + beta * layout.to_tokens(turn_advantages)
    return advantages, advantages


@register_adv_est(AdvantageEstimator.TURN_GAE)
def compute_turn_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: Optional[float] = None,
    lam: Optional[float] = None,
    agent_turn_ids: Optional[torch.Tensor] = None,
    turn_scores: Optional[torch.Tensor] = None,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over agent turns: one step per turn, user turns skipped.

    Turn k's reward is the sum over its tokens of ``token_level_rewards`` plus ``turn_scores`` (if given;
    rewards off the agent turns are ignored), its value the critic's ``values`` at its first token (the value of
    the context the turn was generated from). Scanning a row's turns right to left, delta_k = r_k + gamma *
    V_next - V_k and A_k = delta_k + gamma * lam * A_next, with V_next and A_next those of the row's next turn (0
    after its last). ``gamma`` / ``lam`` fall back to ``config.gamma`` / ``config.lam``. Every token of turn k
    gets A_k (then whitened over the batch's agent tokens, as GAE) and the return A_k + V_k; tokens off the agent
    turns get 0. Returns ``(advantages, returns)``.
    """
    _check_same_shape(token_level_rewards=token_level_rewards, values=values, response_mask=response_mask)
    gamma = _config_number(gamma, config, ("gamma",), "gamma")
    lam = _config_number(lam, config, ("lam",), "lam")
    if turn_scores is not None:
        check_turn_scores(turn_scores, response_mask)
    with torch.no_grad():
        mask = response_mask.to(values.dtype)
        layout = _layout(response_mask, agent_turn_ids)
        token_rewards = token_level_rewards.to(values.dtype)
        if turn_scores is not None:
            token_rewards = token_rewards + turn_scores.to(values.dtype)
        rewards = layout.sum_per_turn(token_rewards)
        turn_values = layout.at_first_token(values)
        turn_advantages = torch.zeros_like(rewards)
        next_value = torch.zeros_like(values[:, 0])
        next_advantage = torch.zeros_like(values[:, 0])
        for k in reversed(range(layout.num_turns)):
            here = layout.present[:, k]
            advantage = rewards[:, k] + gamma * next_value - turn_values[:, k] + gamma * lam * next_advantage
            turn_advantages[:, k] = torch.where(here, advantage, torch.zeros_like(advantage))
            next_value = torch.where(here, turn_values[:, k], next_value)
            next_advantage = torch.where(here, advantage, next_advantage)
        returns = layout.to_tokens(turn_advantages + turn_values)
        advantages = verl_F.masked_whiten(layout.to_tokens(turn_advantages), mask) * mask
    return advantages, returns
