"""PPO / GRPO losses: the in-reward KL penalty, loss aggregation, policy/value/entropy losses (with the
REINFORCE and bypass-mode losses of rollout correction) and the policy-loss registry.

Names, parameter orders and semantics follow veRL's ``verl.trainer.ppo.core_algos`` so that code and configs
written for veRL carry over. All tensors are (batch, response_length) unless stated; ``response_mask`` is 1 on
tokens that carry loss (the policy's own tokens) and 0 on padding and on user/observation tokens.

Loss aggregation (:func:`agg_loss`) takes the global counts of the mini-batch (``dp_size``,
``batch_num_tokens``, ``global_batch_size``) so that summing the micro-batch losses on each rank and averaging
the gradients over the data-parallel ranks (what FSDP does) gives the loss of the unsplit mini-batch, whatever
the DP world size and micro-batch split. Callers then backpropagate each micro-batch loss as is, with no extra
gradient-accumulation scaling.

Two parts that veRL keeps in this module live next to it and are re-exported here under their veRL names:
the advantage estimators, their registry and :class:`AdvantageEstimator` in :mod:`verl.trainer.ppo.advantages`
(``core_algos.compute_grpo_outcome_advantage``, ``core_algos.get_adv_estimator_fn``, ...), and the KL
estimators and KL controllers in :mod:`verl.trainer.ppo.kl` (``core_algos.kl_penalty``,
``core_algos.FixedKLController``, ...).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

import verl.utils.torch_functional as verl_F
from verl.trainer.ppo._checks import _cfg_get, _check_same_shape, _registering_decorator
from verl.trainer.ppo.advantages import (
    ADV_ESTIMATOR_REGISTRY,
    AdvantageEstimator,
    _registry_name,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
)
from verl.trainer.ppo.advantages_turn import compute_turn_gae_advantage_return, compute_turn_mixed_advantage
from verl.trainer.ppo.advantages_vectorized import (
    compute_grpo_vectorized_outcome_advantage,
    compute_rloo_vectorized_outcome_advantage,
)
from verl.trainer.ppo.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    get_kl_controller,
    kl_penalty,
    kl_penalty_forward,
)
from verl.trainer.ppo.rollout_corr_helper import rollout_correction_tensors

__all__ = [
    "ADV_ESTIMATOR_REGISTRY", "KL_ESTIMATORS", "LOSS_AGG_MODES", "POLICY_LOSS_REGISTRY", "AdaptiveKLController",
    "AdvantageEstimator", "FixedKLController", "agg_loss", "compute_entropy_loss", "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage", "compute_grpo_vectorized_outcome_advantage", "compute_policy_loss",
    "compute_policy_loss_bypass_mode", "compute_policy_loss_reinforce", "compute_policy_loss_vanilla",
    "compute_rloo_vectorized_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage", "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage", "compute_rewards", "compute_rloo_outcome_advantage",
    "compute_turn_gae_advantage_return", "compute_turn_mixed_advantage", "compute_value_loss",
    "get_adv_estimator_fn", "get_kl_controller", "get_policy_loss_fn", "kl_penalty", "kl_penalty_forward",
    "register_adv_est", "register_policy_loss",
]  # fmt: skip

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


# ------------------------------------------------------------------------------------------------- registries


# Defined here, not re-exported: as in veRL, they look ``ADV_ESTIMATOR_REGISTRY`` up as this module's attribute, so
# code that swaps ``core_algos.ADV_ESTIMATOR_REGISTRY`` changes what they see (tests/verl/compat pins it).
def register_adv_est(name_or_enum: str | AdvantageEstimator) -> Callable[[Callable], Callable]:
    """Decorator registering an advantage estimator under ``name_or_enum`` (in this module's
    ``ADV_ESTIMATOR_REGISTRY``, the dict of :mod:`~verl.trainer.ppo.advantages`, looked up at call time).

    Registering a different function under a taken name raises ValueError.
    """
    return _registering_decorator(ADV_ESTIMATOR_REGISTRY, _registry_name(name_or_enum), "advantage estimator")


def get_adv_estimator_fn(name_or_enum: str | AdvantageEstimator) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """Return the advantage estimator registered as ``name_or_enum``; ValueError listing the known names if none."""
    name = _registry_name(name_or_enum)
    if name not in ADV_ESTIMATOR_REGISTRY:
        raise ValueError(f"Unknown advantage estimator simply: {name} (registered: {sorted(ADV_ESTIMATOR_REGISTRY)})")
    return ADV_ESTIMATOR_REGISTRY[name]


POLICY_LOSS_REGISTRY: dict[str, Callable[..., tuple[torch.Tensor, dict[str, float]]]] = {}


def register_policy_loss(name: str) -> Callable[[Callable], Callable]:
    """Decorator registering a policy loss function under ``name`` (the value of ``policy_loss.loss_mode``)."""
    return _registering_decorator(POLICY_LOSS_REGISTRY, name, "policy loss")


def get_policy_loss_fn(name: str) -> Callable[..., tuple[torch.Tensor, dict[str, float]]]:
    """Return the policy loss registered as ``name``; ValueError listing the known names if none."""
    if name not in POLICY_LOSS_REGISTRY:
        raise ValueError(f"unknown policy loss {name!r}; registered: {sorted(POLICY_LOSS_REGISTRY)}")
    return POLICY_LOSS_REGISTRY[name]


def _check_loss_config(config: Any, where: str) -> None:
    """Raise TypeError when ``config`` is a number: a clip ratio passed where veRL's order puts ``config``."""
    if isinstance(config, (int, float)) and not isinstance(config, bool):
        raise TypeError(
            f"{where}: the 6th positional argument is `config` (veRL's order: old_log_prob, log_prob, advantages, "
            f"response_mask, loss_agg_mode, config, rollout_is_weights), got the number {config!r}; pass clip "
            "ratios as keywords (clip_ratio_low=..., clip_ratio_high=..., clip_ratio_c=...) or in config"
        )


def _first_set(*candidates: Any) -> Any:
    """The first candidate that is not None."""
    return next(c for c in candidates if c is not None)


def compute_rewards(
    token_level_scores: torch.Tensor, old_log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_ratio: float
) -> torch.Tensor:
    """Token-level rewards with an in-reward KL penalty: scores - kl_ratio * (old_log_prob - ref_log_prob)."""
    return token_level_scores - (old_log_prob - ref_log_prob) * kl_ratio


# ------------------------------------------------------------------------------------------------- aggregation


def _nonzero(count: torch.Tensor | float | int, like: torch.Tensor) -> torch.Tensor:
    """``count`` as a tensor of ``like``'s dtype, with 0 replaced by 1 (the numerator is then 0 too)."""
    count = torch.as_tensor(count, dtype=like.dtype, device=like.device)
    return torch.where(count == 0, torch.ones_like(count), count)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a (bs, T) loss matrix into a scalar.

    - ``token-mean``: sum(loss * mask) / batch_num_tokens * dp_size (batch_num_tokens: the mini-batch's mask
      sum over all ranks; default the local mask sum).
    - ``seq-mean-token-sum``: each row's token sum, summed over non-empty rows, / global_batch_size * dp_size
      (global_batch_size: the mini-batch's non-empty rows over all ranks; default the local count).
    - ``seq-mean-token-mean``: as above with each row's token mean.
    - ``seq-mean-token-sum-norm`` (Dr.GRPO): the ``seq-mean-token-sum`` value divided by ``loss_scale_factor``
      (default the horizon T = loss_mask.shape[-1], the padded response length; set a constant for a scale
      that does not follow the padding), i.e. the mean over sequences of token sums / T, as in the Dr.GRPO
      paper and veRL >= 0.8.0.

    With the global counts, the micro-batch losses of each rank summed, then averaged over ranks, equal the
    loss of the whole mini-batch. Empty denominators count as 1 (their numerators are 0). Values at masked
    positions are ignored, even inf/NaN (``masked_sum`` selects rather than multiplies).
    """
    if tuple(loss_mat.shape) != tuple(loss_mask.shape) or loss_mat.dim() != 2:
        raise ValueError(
            f"loss_mat {tuple(loss_mat.shape)} and loss_mask {tuple(loss_mask.shape)} must share one 2-D shape"
        )
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        num_tokens = mask.sum() if batch_num_tokens is None else batch_num_tokens
        return verl_F.masked_sum(loss_mat, mask) / _nonzero(num_tokens, loss_mat) * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        row_tokens = mask.sum(dim=-1)
        row_losses = verl_F.masked_sum(loss_mat, mask, axis=-1)
        if loss_agg_mode == "seq-mean-token-mean":
            row_losses = row_losses / _nonzero(row_tokens, loss_mat)
        non_empty = (row_tokens > 0).to(loss_mat.dtype)
        num_rows = non_empty.sum() if global_batch_size is None else global_batch_size
        loss = (row_losses * non_empty).sum() / _nonzero(num_rows, loss_mat) * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            scale = loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
            if not scale > 0:
                raise ValueError(f"loss_scale_factor must be > 0, got {scale}")
            loss = loss / scale
        return loss
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; expected one of {list(LOSS_AGG_MODES)}")


# ------------------------------------------------------------------------------------------------------ losses


def _clipped_pg_losses(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token dual-clip PPO losses and the (clipfrac, ppo_kl, clipfrac_lower) masked means."""
    _check_same_shape(
        old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask
    )
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip bound) must be > 1.0, got {clip_ratio_c}")
    mask = response_mask.to(log_prob.dtype)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    ppo_losses = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * clip_ratio_c
    negative_adv = advantages < 0
    pg_losses = torch.where(negative_adv, torch.minimum(ppo_losses, dual_bound), ppo_losses)
    with torch.no_grad():
        clipfrac = verl_F.masked_mean((clipped > unclipped).to(mask.dtype), mask)
        ppo_kl = verl_F.masked_mean(-log_ratio, mask)
        clipfrac_lower = verl_F.masked_mean(((ppo_losses > dual_bound) & negative_adv).to(mask.dtype), mask)
    return pg_losses, clipfrac, ppo_kl, clipfrac_lower


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    *,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = None,
    **agg_kwargs: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped PPO policy loss with asymmetric clip and dual clip; positional order as veRL (>= 0.5):
    ``(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)``.

    ratio = exp(clamp(log_prob - old_log_prob, -20, 20)); per token max(-A*ratio, -A*clip(ratio, 1-low,
    1+high)), and for A < 0 additionally min(that, -A*clip_ratio_c) (dual clip, clip_ratio_c > 1). Optional
    ``rollout_is_weights`` multiply the per-token losses. ``config`` is the actor config (clip_ratio,
    clip_ratio_low, clip_ratio_high, clip_ratio_c; ``global_batch_info``: the :func:`agg_loss` counts, as veRL
    sets them). The keyword-only clip settings override it, else 0.2 / 0.2 / 3.0; ``agg_kwargs`` (dp_size,
    batch_num_tokens, global_batch_size, loss_scale_factor) override ``config.global_batch_info``. Returns
    ``(pg_loss, {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"})``, the metrics as detached 0-d
    tensors (read once per mini-batch by the actor).
    """
    _check_loss_config(config, "compute_policy_loss_vanilla")
    base = _first_set(_cfg_get(config, "clip_ratio"), 0.2)
    clip_ratio_low = _first_set(clip_ratio_low, _cfg_get(config, "clip_ratio_low"), base)
    clip_ratio_high = _first_set(clip_ratio_high, _cfg_get(config, "clip_ratio_high"), base)
    clip_ratio_c = _first_set(clip_ratio_c, _cfg_get(config, "clip_ratio_c"), 3.0)
    pg_losses, clipfrac, ppo_kl, clipfrac_lower = _clipped_pg_losses(
        old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high, clip_ratio_c
    )
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    agg_kwargs = {**(_cfg_get(config, "global_batch_info") or {}), **agg_kwargs}
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs)
    metrics = {  # detached tensors: the caller reads them from the device once per mini-batch
        "actor/pg_clipfrac": clipfrac.detach(),
        "actor/ppo_kl": ppo_kl.detach(),
        "actor/pg_clipfrac_lower": clipfrac_lower.detach(),
    }
    return pg_loss, metrics


def compute_policy_loss_reinforce(
    rollout_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-sum",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    **agg_kwargs: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REINFORCE with optional importance weights (veRL's bypass-mode ``loss_type=reinforce``): per token
    ``-A * log_prob * w`` (``w`` = ``rollout_is_weights``, detached, or 1), no clipping, aggregated by
    :func:`agg_loss` (``config.global_batch_info`` / ``agg_kwargs`` as in :func:`compute_policy_loss_vanilla`).
    Returns ``(pg_loss, {"actor/ppo_kl": mean(rollout_log_prob - log_prob)})``."""
    _check_loss_config(config, "compute_policy_loss_reinforce")
    _check_same_shape(rollout_log_prob=rollout_log_prob, log_prob=log_prob, advantages=advantages,
                      response_mask=response_mask)
    pg_losses = -advantages * log_prob
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach()
    agg_kwargs = {**(_cfg_get(config, "global_batch_info") or {}), **agg_kwargs}
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs)
    with torch.no_grad():
        ppo_kl = verl_F.masked_mean(rollout_log_prob - log_prob, response_mask.to(log_prob.dtype))
    return pg_loss, {"actor/ppo_kl": ppo_kl.detach()}


@register_policy_loss("bypass_mode")
def compute_policy_loss_bypass_mode(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    *,
    turn_ids: torch.Tensor | None = None,
    **agg_kwargs: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss of rollout-correction bypass mode, where ``old_log_prob`` are the rollout's log-probs.

    IS weights and the rejection mask of ``config.policy_loss.rollout_correction`` are computed from the current
    ``log_prob`` against them (without gradient; ``turn_ids`` for turn-level options, default runs of the mask;
    ``rollout_is_batch_normalize`` normalises over this micro-batch). ``loss_type=ppo_clip``: the vanilla PPO loss
    on the rejection mask (its ratio already is pi/pi_rollout; weights only logged); ``reinforce``:
    :func:`compute_policy_loss_reinforce` with the weights. ``rollout_is_weights`` is ignored (veRL's signature).
    Returns the loss and its metrics plus the ``rollout_corr/*`` ones, as detached tensors.
    """
    corr = _cfg_get(_cfg_get(config, "policy_loss"), "rollout_correction")
    if corr is None:
        raise ValueError("policy loss bypass_mode needs config.policy_loss.rollout_correction (the trainer sets it "
                         "when algorithm.rollout_correction.bypass_mode=true)")
    loss_type = _cfg_get(corr, "loss_type", "ppo_clip")
    weights, mask, metrics = None, response_mask, {}
    if bool(response_mask.any()):  # a micro-batch of DP padding rows only has nothing to correct
        weights, mask, metrics = rollout_correction_tensors(
            log_prob.detach(), old_log_prob, response_mask, rollout_is=_cfg_get(corr, "rollout_is"),
            rollout_is_threshold=_cfg_get(corr, "rollout_is_threshold", 2.0),
            rollout_is_batch_normalize=_cfg_get(corr, "rollout_is_batch_normalize", False),
            rollout_rs=_cfg_get(corr, "rollout_rs"), rollout_rs_threshold=_cfg_get(corr, "rollout_rs_threshold"),
            turn_ids=turn_ids)
    if loss_type == "reinforce":
        pg_loss, pg_metrics = compute_policy_loss_reinforce(old_log_prob, log_prob, advantages, mask, loss_agg_mode,
                                                            config, weights, **agg_kwargs)
    elif loss_type == "ppo_clip":
        pg_loss, pg_metrics = compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, mask, loss_agg_mode,
                                                          config, None, **agg_kwargs)
    else:
        raise ValueError(f"rollout_correction.loss_type must be ppo_clip or reinforce, got {loss_type!r}")
    pg_metrics.update(metrics)
    return pg_loss, pg_metrics


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deprecated veRL entry point with the maths of :func:`compute_policy_loss_vanilla`.

    ``cliprange_low``/``cliprange_high`` default to ``cliprange``. Returns ``(pg_loss, pg_clipfrac, ppo_kl,
    pg_clipfrac_lower)`` as tensors.
    """
    warnings.warn(
        "compute_policy_loss is deprecated; use compute_policy_loss_vanilla", DeprecationWarning, stacklevel=2
    )
    low = cliprange if cliprange_low is None else cliprange_low
    high = cliprange if cliprange_high is None else cliprange_high
    if low is None or high is None:
        raise ValueError("compute_policy_loss needs cliprange, or both cliprange_low and cliprange_high")
    pg_losses, clipfrac, ppo_kl, clipfrac_lower = _clipped_pg_losses(
        old_log_prob, log_prob, advantages, response_mask, low, high, clip_ratio_c
    )
    return agg_loss(pg_losses, response_mask, loss_agg_mode), clipfrac, ppo_kl, clipfrac_lower


def compute_entropy_loss(
    logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", **agg_kwargs: Any
) -> torch.Tensor:
    """Aggregated categorical entropy of ``logits`` (bs, T, vocab) over the loss-carrying tokens."""
    token_entropy = verl_F.entropy_from_logits(logits)
    return agg_loss(token_entropy, response_mask, loss_agg_mode, **agg_kwargs)


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    **agg_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss 0.5 * agg(max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2)).

    Returns ``(vf_loss, vf_clipfrac)``; vf_clipfrac is the masked fraction of tokens where the clipped term is
    larger. ``agg_kwargs`` go to :func:`agg_loss`.
    """
    _check_same_shape(vpreds=vpreds, returns=returns, values=values, response_mask=response_mask)
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    losses_unclipped = (vpreds - returns).square()
    losses_clipped = (vpred_clipped - returns).square()
    token_losses = torch.maximum(losses_unclipped, losses_clipped)
    vf_loss = 0.5 * agg_loss(token_losses, response_mask, loss_agg_mode, **agg_kwargs)
    with torch.no_grad():
        mask = response_mask.to(vpreds.dtype)
        vf_clipfrac = verl_F.masked_mean((losses_clipped > losses_unclipped).to(mask.dtype), mask)
    return vf_loss, vf_clipfrac
