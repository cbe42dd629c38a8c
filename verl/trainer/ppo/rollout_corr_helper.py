"""Rollout correction: importance weights and rejection masks for the gap between the rollout engine's policy
and the training policy (veRL 0.9.x's ``verl.trainer.ppo.rollout_corr_helper``: same names, signatures, return
values and metric names).

The rollout engine (vLLM in bf16, say) samples tokens from pi_rollout; the trainer recomputes them under
pi_train (FSDP, fp32). With ``log_ratio = log pi_train - log pi_rollout`` per token:

- importance weights (``rollout_is``) re-weight each token's loss by the ratio of its unit, truncated above
  (TIS) or zeroed outside bounds (IcePop); units are tokens, whole sequences, or (SEAD) agent turns, a turn's
  ratio being the product of its tokens' ratios (the exponential of their summed log-ratios);
- rejection (``rollout_rs``) removes tokens, turns or sequences whose divergence estimate is out of bounds from
  ``response_mask`` (what that means to the advantages and the rest of the step:
  :mod:`verl.trainer.ppo.rollout_rejection`);
- off-policy metrics measure the gap (KL, perplexities, chi-square).

Option syntax: :mod:`verl.trainer.ppo.rollout_corr_options`; units: :mod:`verl.trainer.ppo.rollout_corr_units`;
metrics: :mod:`verl.trainer.ppo.rollout_corr_metrics`. The functions taking tensors accept ``turn_ids`` (bs, R),
the agent turn of every loss token (-1 elsewhere; default: maximal runs of ``response_mask``) as a keyword after
veRL's parameters. Weights and masks are computed without gradient.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from verl.errors import ContractError
from verl.protocol import DataProto
from verl.trainer.ppo._checks import _cfg_get
from verl.trainer.ppo.rollout_corr_metrics import SAFETY_BOUND, is_metrics, offpolicy_metrics, rs_metrics
from verl.trainer.ppo.rollout_corr_options import (
    IS_LEVELS,
    SUPPORTED_ROLLOUT_RS_OPTIONS,
    TOKEN_LEVEL_ROLLOUT_RS_OPTIONS,
    Threshold,
    parse_rollout_is_threshold,
    rejection_options,
)
from verl.trainer.ppo.rollout_corr_units import Units
from verl.trainer.ppo.rollout_rejection import apply_rejection
from verl.utils.agent_turns import agent_turn_ids
from verl.utils.torch_functional import k3_divergence, masked_mean

__all__ = ["SAFETY_BOUND", "SUPPORTED_ROLLOUT_RS_OPTIONS", "TOKEN_LEVEL_ROLLOUT_RS_OPTIONS", "apply_bypass_mode",
           "compute_offpolicy_metrics", "compute_rollout_corr_metrics_from_logprobs",
           "compute_rollout_correction_and_add_to_batch", "compute_rollout_correction_and_rejection_mask",
           "compute_rollout_correction_weights", "compute_rollout_rejection_mask", "rollout_correction_for_batch",
           "rollout_correction_tensors"]

Metrics = dict[str, torch.Tensor]


def _floats(metrics: Metrics) -> dict[str, float]:
    """The metrics as Python floats, read from the device in one transfer."""
    if not metrics:
        return {}
    values = torch.stack([v.detach().reshape(()).to(torch.float64) for v in metrics.values()]).tolist()
    return dict(zip(metrics, values))


def _weights(log_ratio: torch.Tensor, response_mask: torch.Tensor, rollout_is: str, threshold: Threshold,
             batch_normalize: bool, turn_ids: Optional[torch.Tensor]) -> tuple[torch.Tensor, Metrics]:
    """IS weights (bs, R) and their metrics as tensors (see :func:`compute_rollout_correction_weights`)."""
    if rollout_is not in IS_LEVELS:
        raise ValueError(f"rollout_is must be one of {list(IS_LEVELS)} (or None), got {rollout_is!r}")
    upper, lower = parse_rollout_is_threshold(threshold)
    log_ratio = log_ratio.detach()
    units = Units.for_level(rollout_is, response_mask, turn_ids)
    unit_log_ratio = units.sum(log_ratio)
    unit_raw = unit_log_ratio.clamp(min=-SAFETY_BOUND, max=SAFETY_BOUND).exp()
    if lower is None:  # TIS: truncate above
        unit_weights = unit_raw.clamp(max=upper)
    else:  # IcePop: zero outside [lower, upper]
        unit_weights = torch.where((unit_raw >= lower) & (unit_raw <= upper), unit_raw, torch.zeros_like(unit_raw))
    raw, weights = units.spread(unit_raw), units.spread(unit_weights)
    metrics = is_metrics(weights, raw, unit_log_ratio, units, response_mask, rollout_is, upper, lower)
    if batch_normalize:  # mean 1 over the units (tokens, turns or sequences) of this batch
        if rollout_is == "token":
            mean = masked_mean(weights, response_mask)
        else:
            kept = torch.where(units.valid, unit_weights, torch.zeros_like(unit_weights))
            mean = kept.sum() / units.valid.sum().clamp(min=1).to(kept.dtype)
        factor = torch.where(mean > 1e-8, mean, torch.ones_like(mean))
        weights = weights / factor
        metrics["rollout_is_batch_norm_factor"] = factor
    return weights, metrics


def _rejection(log_ratio: torch.Tensor, response_mask: torch.Tensor, rollout_rs: str,
               threshold: Optional[Threshold], turn_ids: Optional[torch.Tensor]) -> tuple[torch.Tensor, Metrics]:
    """The response mask with rejected tokens set to 0 and the metrics (see :func:`compute_rollout_rejection_mask`)."""
    options = rejection_options(rollout_rs, threshold)
    safe = log_ratio.detach().clamp(min=-SAFETY_BOUND, max=SAFETY_BOUND)
    estimates = {"k1": -safe, "k2": 0.5 * safe.square(), "k3": k3_divergence(safe)}
    units_by_level: dict[str, Units] = {}
    inside = response_mask != 0
    keep_all = torch.ones_like(inside)
    metrics: Metrics = {}
    for option in options:
        per_token = estimates[option.estimator]
        units = unit_stat = None
        token_stat = per_token
        if option.level != "token":
            if option.level not in units_by_level:
                units_by_level[option.level] = Units.for_level(option.level, response_mask, turn_ids)
            units = units_by_level[option.level]
            unit_stat = getattr(units, option.aggregate)(per_token)
            token_stat = units.spread(unit_stat)
        keep = token_stat <= option.high
        if option.low is not None:
            keep = keep & (token_stat >= option.low)
        metrics.update(rs_metrics(option, token_stat, unit_stat, units, keep, response_mask))
        keep_all = keep_all & keep
    rejected = ~keep_all & inside
    dtype = safe.dtype
    metrics["rollout_rs_masked_fraction"] = masked_mean(rejected.to(dtype), response_mask)
    rows = inside.any(dim=-1)
    metrics["rollout_rs_seq_masked_fraction"] = (rejected.any(dim=-1) & rows).sum().to(dtype) / rows.sum().clamp(min=1)
    return (response_mask * keep_all).to(response_mask.dtype), metrics


def _require_tokens(response_mask: torch.Tensor) -> None:
    if not bool(response_mask.any()):
        raise ContractError("response_mask must contain at least one valid token (1)")


def compute_rollout_correction_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: Threshold = 2.0,
    rollout_is_batch_normalize: bool = False,
    *,
    turn_ids: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated (TIS) or masked (IcePop) importance weights pi_train / pi_rollout, (bs, R), 0 outside the mask.

    ``rollout_is``: ``token`` (each token's own ratio), ``turn`` (the ratio of its agent turn: exp of the sum of
    the turn's log-ratios) or ``sequence`` (of its whole response); every ratio is exp(clamp(log-ratio, -20,
    20)). A single-number ``rollout_is_threshold`` truncates ratios above it; ``"lower_upper"`` zeroes ratios
    outside [lower, upper]. ``rollout_is_batch_normalize`` divides by the mean weight of the batch's units
    (tokens, turns or sequences) when that mean is > 1e-8. Returns ``(weights, metrics)``: ``rollout_is_mean |
    max | min | std | eff_sample_size | ratio_fraction_high | ratio_fraction_low``, ``rollout_is_seq_*``,
    ``rollout_is_oob_ratio`` (IcePop), ``rollout_is_batch_norm_factor`` (normalised), all of the weights before
    normalisation.
    """
    weights, metrics = _weights(log_ratio, response_mask, rollout_is, rollout_is_threshold,
                                rollout_is_batch_normalize, turn_ids)
    return weights, _floats(metrics)


def compute_rollout_rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_rs: str = "token_k1",
    rollout_rs_threshold: Optional[Threshold] = None,
    *,
    turn_ids: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``response_mask`` with the tokens that fail any ``rollout_rs`` option set to 0, and the metrics.

    A token-level option judges each token; a ``seq_*`` option each sequence and a ``turn_*`` option each agent
    turn by the sum, mean or max of its tokens' estimates, rejecting all of its tokens together. Metrics per
    option ``rollout_rs_<option>_{mean,max,min,std,fraction_high,fraction_low,seq_*,masked_fraction,
    seq_masked_fraction}`` (turn options also ``turn_masked_fraction``) and overall ``rollout_rs_masked_fraction``
    (tokens) and ``rollout_rs_seq_masked_fraction`` (sequences with a rejected token). An empty batch is returned
    as it is; a batch without a loss token is a ContractError.
    """
    if rollout_rs is None or rollout_rs_threshold is None:
        raise ValueError("compute_rollout_rejection_mask needs rollout_rs and rollout_rs_threshold")
    if log_ratio.shape[0] == 0:
        return response_mask, {}
    _require_tokens(response_mask)
    mask, metrics = _rejection(log_ratio, response_mask, rollout_rs, rollout_rs_threshold, turn_ids)
    return mask, _floats(metrics)


def rollout_correction_tensors(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: Optional[str] = None,
    rollout_is_threshold: Optional[Threshold] = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: Optional[str] = None,
    rollout_rs_threshold: Optional[Threshold] = None,
    *,
    turn_ids: Optional[torch.Tensor] = None,
) -> tuple[Optional[torch.Tensor], torch.Tensor, Metrics]:
    """:func:`compute_rollout_correction_and_rejection_mask` with the weights as a tensor and the metrics as
    0-d tensors (kept on the device: the actor reads them once per mini-batch)."""
    _require_tokens(response_mask)
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        raise ContractError(f"old_log_prob {tuple(old_log_prob.shape)}, rollout_log_prob "
                            f"{tuple(rollout_log_prob.shape)} and response_mask {tuple(response_mask.shape)} "
                            "must have one shape")
    old_log_prob, rollout_log_prob = old_log_prob.detach(), rollout_log_prob.detach()
    log_ratio = old_log_prob - rollout_log_prob
    metrics: Metrics = {}
    weights = None
    if rollout_is is not None and rollout_is_threshold is not None:
        weights, is_part = _weights(log_ratio, response_mask, rollout_is, rollout_is_threshold,
                                    rollout_is_batch_normalize, turn_ids)
        metrics.update(is_part)
    mask = response_mask.clone()
    if rollout_rs is not None:
        if rollout_rs_threshold is None:
            raise ValueError("rollout_rs_threshold must be set when rollout_rs is")
        mask, rs_part = _rejection(log_ratio, response_mask, rollout_rs, rollout_rs_threshold, turn_ids)
        metrics.update(rs_part)
    metrics.update(offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask))
    return weights, mask, {f"rollout_corr/{key}": value for key, value in metrics.items()}


def compute_rollout_correction_and_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: Optional[str] = None,
    rollout_is_threshold: Optional[Threshold] = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: Optional[str] = None,
    rollout_rs_threshold: Optional[Threshold] = None,
    *,
    turn_ids: Optional[torch.Tensor] = None,
) -> tuple[Optional[DataProto], torch.Tensor, dict[str, float]]:
    """IS weights, rejection mask and off-policy metrics in one call.

    ``old_log_prob`` are the training policy's log-probs, ``rollout_log_prob`` the rollout engine's, both (bs, R).
    Returns ``(weights, modified_response_mask, metrics)``: ``weights`` a DataProto holding ``rollout_is_weights``
    (None when ``rollout_is`` or ``rollout_is_threshold`` is None), the mask after rejection (a copy of
    ``response_mask`` without ``rollout_rs``), and every metric of :func:`compute_rollout_correction_weights`,
    :func:`compute_rollout_rejection_mask` and :func:`compute_offpolicy_metrics` prefixed ``rollout_corr/``.
    """
    weights, mask, metrics = rollout_correction_tensors(
        old_log_prob, rollout_log_prob, response_mask, rollout_is, rollout_is_threshold,
        rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold, turn_ids=turn_ids)
    proto = None if weights is None else DataProto.from_dict(tensors={"rollout_is_weights": weights})
    return proto, mask, _floats(metrics)


def compute_offpolicy_metrics(old_log_prob: torch.Tensor, rollout_log_prob: Optional[torch.Tensor],
                              response_mask: torch.Tensor) -> dict[str, Any]:
    """Off-policy diagnostics without prefix: ``training_ppl``, ``training_log_ppl`` and, with rollout
    log-probs, ``kl``, ``k3_kl``, ``rollout_ppl``, ``rollout_log_ppl``, ``log_ppl_diff``, ``log_ppl_abs_diff``,
    ``log_ppl_diff_max``, ``log_ppl_diff_min``, ``ppl_ratio``, ``chi2_token``, ``chi2_seq``
    (see :func:`verl.trainer.ppo.rollout_corr_metrics.offpolicy_metrics`)."""
    _require_tokens(response_mask)
    rollout = None if rollout_log_prob is None else rollout_log_prob.detach()
    return _floats(offpolicy_metrics(old_log_prob.detach(), rollout, response_mask))


def compute_rollout_corr_metrics_from_logprobs(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                                               response_mask: torch.Tensor) -> dict[str, float]:
    """:func:`compute_offpolicy_metrics` of the current policy's log-probs, prefixed ``rollout_corr/``."""
    metrics = compute_offpolicy_metrics(log_prob, rollout_log_prob, response_mask)
    return {f"rollout_corr/{key}": value for key, value in metrics.items()}


def rollout_correction_for_batch(batch: DataProto, rollout_corr_config: Any) -> tuple[Optional[torch.Tensor], dict]:
    """``algorithm.rollout_correction`` on a batch holding ``old_log_probs``, ``rollout_log_probs`` and
    ``response_mask``: ``rollout_is_weights`` added when ``rollout_is`` is set; returns ``(kept, rollout_corr/*
    metrics)``, ``kept`` the mask after rejection (None without ``rollout_rs``), not yet applied: the trainer applies
    it after the advantages (:mod:`verl.trainer.ppo.rollout_rejection`). Turns come from
    :func:`verl.utils.agent_turns.agent_turn_ids`."""
    get = lambda key, default=None: _cfg_get(rollout_corr_config, key, default)  # noqa: E731
    rollout_is, rollout_rs = get("rollout_is"), get("rollout_rs")
    turn_ids = agent_turn_ids(batch.batch) if rollout_is == "turn" or rollout_rs is not None else None
    weights, mask, metrics = compute_rollout_correction_and_rejection_mask(
        old_log_prob=batch.batch["old_log_probs"], rollout_log_prob=batch.batch["rollout_log_probs"],
        response_mask=batch.batch["response_mask"], rollout_is=rollout_is,
        rollout_is_threshold=get("rollout_is_threshold", 2.0),
        rollout_is_batch_normalize=get("rollout_is_batch_normalize", False), rollout_rs=rollout_rs,
        rollout_rs_threshold=get("rollout_rs_threshold"), turn_ids=turn_ids)
    if weights is not None:
        batch.batch["rollout_is_weights"] = weights.batch["rollout_is_weights"]
    return (mask if rollout_rs is not None else None), metrics


def compute_rollout_correction_and_add_to_batch(batch: DataProto, rollout_corr_config: Any) -> tuple[DataProto, dict]:
    """veRL's entry point: :func:`rollout_correction_for_batch`, then the rejection applied at once
    (:func:`verl.trainer.ppo.rollout_rejection.apply_rejection`: ``response_mask`` without the rejected tokens,
    their ``agent_turn_ids`` -1, the kept tokens' turn numbers unchanged); returns ``(batch, rollout_corr/*
    metrics)``. Advantages computed after it would read the post-rejection mask: the trainer uses
    :func:`rollout_correction_for_batch` and the rule instead."""
    kept, metrics = rollout_correction_for_batch(batch, rollout_corr_config)
    if kept is not None:
        apply_rejection(batch, kept)
    return batch, metrics


def apply_bypass_mode(batch: DataProto, rollout_corr_config: Any = None, policy_loss_config: Any = None) -> None:
    """Bypass mode: the rollout's log-probs become the old log-probs (the old-log-prob pass is skipped).

    ``rollout_log_probs`` is moved to ``old_log_probs`` (veRL copies it; moved, no training/rollout mismatch of
    zero is reported for it). With a ``policy_loss_config`` mapping, its ``loss_mode`` is set to ``bypass_mode``
    and ``rollout_correction`` to ``rollout_corr_config``, as veRL does, for an actor built from that config.
    """
    if "rollout_log_probs" not in batch.batch.keys():
        raise ValueError("algorithm.rollout_correction.bypass_mode=true needs rollout_log_probs in the batch: set "
                         "actor_rollout_ref.rollout.calculate_log_probs=true (and use a rollout that returns them)")
    batch.batch["old_log_probs"] = batch.batch.pop("rollout_log_probs")
    if policy_loss_config is not None:
        policy_loss_config["loss_mode"] = "bypass_mode"
        policy_loss_config["rollout_correction"] = rollout_corr_config
