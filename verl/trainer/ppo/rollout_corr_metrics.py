"""The metrics of rollout correction under veRL's (0.9.x) names, as 0-d tensors (read once by the caller).

IS metrics (``rollout_is_*``) describe the weights before batch normalisation; rejection metrics
(``rollout_rs_<option>_*``) the statistic each option thresholds; off-policy metrics (``kl``, ``k3_kl``,
``*_ppl``, ``chi2_*``, ...) the gap between the training and the rollout policy. Token means are veRL's masked
means; per-sequence (and per-turn) statistics are taken over the rows (turns) that have at least one
loss-carrying token: a row without one is no sequence (veRL counts it as one of ratio 1, weight 0 and
perplexity 1), which is the only place where the values can differ from veRL's.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

import verl.utils.torch_functional as verl_F
from verl.trainer.ppo.rollout_corr_options import RejectionOption
from verl.trainer.ppo.rollout_corr_units import Units

__all__ = ["SAFETY_BOUND", "is_metrics", "offpolicy_metrics", "rs_metrics"]

# Log-ratios are clamped to +-SAFETY_BOUND before exponentiation (exp(20) ~ 4.9e8), as in veRL.
SAFETY_BOUND = 20.0

Metrics = dict[str, torch.Tensor]


def _zero(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=like.dtype, device=like.device)


def _mean_over(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Plain mean of ``values`` where ``valid`` (0 if none)."""
    total = torch.where(valid, values, _zero(values)).sum()
    return total / valid.sum().clamp(min=1).to(values.dtype)


def _max_over(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, values, torch.full_like(values, float("-inf"))).max()


def _min_over(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, values, torch.full_like(values, float("inf"))).min()


def _std_over(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Unbiased standard deviation of ``values`` where ``valid`` (0 for fewer than two values)."""
    count = valid.sum().to(values.dtype)
    centred = torch.where(valid, values - _mean_over(values, valid), _zero(values))
    variance = centred.square().sum() / (count - 1).clamp(min=1)
    return torch.where(count > 1, variance.sqrt(), _zero(values))


def _clamped_std(values: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """veRL's token std: sqrt(E[v^2] - E[v]^2) of ``values`` clamped to [low, high] (0 for a single token)."""
    clamped = values.clamp(min=low, max=high)
    mean = verl_F.masked_mean(clamped, mask)
    variance = verl_F.masked_mean(clamped.square(), mask) - mean.square()
    return torch.where(mask.sum() > 1, variance.clamp(min=0.0).sqrt(), _zero(values))


def _row_stats(prefix: str, row_values: torch.Tensor, rows: torch.Tensor, high: float,
               low: Optional[float]) -> Metrics:
    """``<prefix>_seq_{mean,std,max,min,max_deviation,fraction_high[,fraction_low]}`` over the valid rows."""
    out = {f"{prefix}_seq_mean": _mean_over(row_values, rows), f"{prefix}_seq_std": _std_over(row_values, rows),
           f"{prefix}_seq_max": _max_over(row_values, rows), f"{prefix}_seq_min": _min_over(row_values, rows)}
    return out | {f"{prefix}_seq_fraction_high": _mean_over((row_values > high).to(row_values.dtype), rows),
                  **({} if low is None else
                     {f"{prefix}_seq_fraction_low": _mean_over((row_values < low).to(row_values.dtype), rows)})}


def is_metrics(weights: torch.Tensor, raw_weights: torch.Tensor, unit_log_ratio: torch.Tensor, units: Units,
               response_mask: torch.Tensor, level: str, upper: float, lower: Optional[float]) -> Metrics:
    """``rollout_is_*`` of the applied ``weights`` (bs, R), the ``raw_weights`` before truncation/masking and the
    per-unit log-ratios (bs, K); ``lower`` None means TIS (the low fraction then counts ratios below 1/upper)."""
    low = 1.0 / upper if lower is None else lower
    mask = response_mask
    out: Metrics = {"rollout_is_mean": verl_F.masked_mean(weights, mask)}
    if level == "token":
        out["rollout_is_ratio_fraction_high"] = verl_F.masked_mean((raw_weights > upper).to(weights.dtype), mask)
        out["rollout_is_ratio_fraction_low"] = verl_F.masked_mean((raw_weights < low).to(weights.dtype), mask)
        inside = mask.bool()
        out["rollout_is_max"] = _max_over(weights, inside)
        out["rollout_is_min"] = _min_over(weights, inside)
    else:  # one ratio per turn / sequence: extremes and fractions over those units, from their log-ratios
        out["rollout_is_max"] = _max_over(unit_log_ratio, units.valid).clamp(max=SAFETY_BOUND).exp()
        out["rollout_is_min"] = _min_over(unit_log_ratio, units.valid).exp()
        out["rollout_is_ratio_fraction_high"] = _mean_over(
            (unit_log_ratio > math.log(upper)).to(weights.dtype), units.valid)
        out["rollout_is_ratio_fraction_low"] = _mean_over(
            (unit_log_ratio < math.log(low)).to(weights.dtype), units.valid)
    out["rollout_is_std"] = _clamped_std(weights, mask, 0.0, upper)
    bounded = weights.clamp(min=0.0, max=upper)
    normalised = bounded / (verl_F.masked_mean(bounded, mask) + 1e-8)
    out["rollout_is_eff_sample_size"] = 1.0 / verl_F.masked_mean(normalised.square(), mask)
    rows = mask.sum(dim=-1) > 0
    seq_weights = verl_F.masked_mean(weights, mask, axis=-1)
    out.update({"rollout_is_seq_mean": _mean_over(seq_weights, rows), "rollout_is_seq_std": _std_over(seq_weights, rows),
                "rollout_is_seq_max": _max_over(seq_weights, rows), "rollout_is_seq_min": _min_over(seq_weights, rows),
                "rollout_is_seq_max_deviation": _max_over((seq_weights - 1.0).abs(), rows)})
    raw_seq_weights = verl_F.masked_mean(raw_weights, mask, axis=-1)
    out["rollout_is_seq_fraction_high"] = _mean_over((raw_seq_weights > upper).to(weights.dtype), rows)
    out["rollout_is_seq_fraction_low"] = _mean_over((raw_seq_weights < low).to(weights.dtype), rows)
    if lower is not None:
        outside = (raw_weights < lower) | (raw_weights > upper)
        out["rollout_is_oob_ratio"] = verl_F.masked_mean(outside.to(weights.dtype), mask)
    return out


def rs_metrics(option: RejectionOption, token_stat: torch.Tensor, unit_stat: Optional[torch.Tensor],
               units: Optional[Units], keep: torch.Tensor, response_mask: torch.Tensor) -> Metrics:
    """``rollout_rs_<option>_*`` of one rejection option: ``token_stat`` (bs, R) is the statistic each token is
    judged by (its unit's for turn/sequence options, whose per-unit values ``unit_stat`` (bs, K) are over
    ``units``); ``keep`` (bs, R) bool the tokens the option keeps."""
    prefix = f"rollout_rs_{option.name}"
    mask = response_mask
    is_k1 = option.estimator == "k1"
    high, low = option.high, (option.low if is_k1 else 0.0)
    dtype = token_stat.dtype
    out: Metrics = {f"{prefix}_mean": verl_F.masked_mean(token_stat, mask)}
    if unit_stat is None:
        inside = mask.bool()
        out[f"{prefix}_max"], out[f"{prefix}_min"] = _max_over(token_stat, inside), _min_over(token_stat, inside)
        out[f"{prefix}_fraction_high"] = verl_F.masked_mean((token_stat > high).to(dtype), mask)
        out[f"{prefix}_fraction_low"] = (verl_F.masked_mean((token_stat < low).to(dtype), mask) if is_k1
                                         else _zero(token_stat))
    else:
        valid = units.valid
        out[f"{prefix}_max"], out[f"{prefix}_min"] = _max_over(unit_stat, valid), _min_over(unit_stat, valid)
        out[f"{prefix}_fraction_high"] = _mean_over((unit_stat > high).to(dtype), valid)
        out[f"{prefix}_fraction_low"] = (_mean_over((unit_stat < low).to(dtype), valid) if is_k1
                                         else _zero(token_stat))
    out[f"{prefix}_std"] = _clamped_std(token_stat, mask, low, high)
    rows = mask.sum(dim=-1) > 0
    row_values = unit_stat[:, 0] if option.level == "sequence" else verl_F.masked_mean(token_stat, mask, axis=-1)
    out.update(_row_stats(prefix, row_values, rows, high, low if is_k1 else None))
    out[f"{prefix}_seq_max_deviation"] = _max_over(row_values.abs(), rows)
    rejected = ~keep & mask.bool()
    out[f"{prefix}_masked_fraction"] = verl_F.masked_mean(rejected.to(dtype), mask)
    out[f"{prefix}_seq_masked_fraction"] = _mean_over(rejected.any(dim=-1).to(dtype), rows)
    if option.level == "turn":
        turn_rejected = units.sum(rejected.to(dtype)) > 0
        out[f"{prefix}_turn_masked_fraction"] = _mean_over(turn_rejected.to(dtype), units.valid)
    return out


def offpolicy_metrics(old_log_prob: torch.Tensor, rollout_log_prob: Optional[torch.Tensor],
                      response_mask: torch.Tensor) -> Metrics:
    """veRL's off-policy diagnostics (without prefix): ``training_ppl``/``training_log_ppl`` and, with rollout
    log-probs, ``kl`` (E[log pi_rollout - log pi_train]), ``k3_kl``, ``rollout_ppl``/``rollout_log_ppl``,
    ``log_ppl_diff`` (mean, ``_abs``, ``_max``, ``_min`` over rows), ``ppl_ratio``, ``chi2_token`` and ``chi2_seq``."""
    mask = response_mask
    rows = mask.sum(dim=-1) > 0
    train_mean = verl_F.masked_mean(old_log_prob, mask, axis=-1)
    out: Metrics = {"training_ppl": _mean_over((-train_mean).exp(), rows),
                    "training_log_ppl": _mean_over(-train_mean, rows)}
    if rollout_log_prob is None:
        return out
    log_ratio = old_log_prob - rollout_log_prob
    out["kl"] = verl_F.masked_mean(-log_ratio, mask)
    out["k3_kl"] = verl_F.masked_mean(verl_F.k3_divergence(log_ratio), mask)
    rollout_mean = verl_F.masked_mean(rollout_log_prob, mask, axis=-1)
    out["rollout_ppl"] = _mean_over((-rollout_mean).exp(), rows)
    out["rollout_log_ppl"] = _mean_over(-rollout_mean, rows)
    log_ppl_diff = rollout_mean - train_mean
    out.update({"log_ppl_diff": _mean_over(log_ppl_diff, rows), "log_ppl_abs_diff": _mean_over(log_ppl_diff.abs(), rows),
                "log_ppl_diff_max": _max_over(log_ppl_diff, rows), "log_ppl_diff_min": _min_over(log_ppl_diff, rows),
                "ppl_ratio": _mean_over(log_ppl_diff.exp(), rows)})
    safe = log_ratio.clamp(min=-SAFETY_BOUND, max=SAFETY_BOUND)
    out["chi2_token"] = verl_F.masked_mean(safe.exp().square(), mask) - 1.0
    seq_log_ratio = verl_F.masked_sum(log_ratio, mask, axis=-1).clamp(min=-SAFETY_BOUND, max=SAFETY_BOUND)
    out["chi2_seq"] = _mean_over((2.0 * seq_log_ratio).exp(), rows) - 1.0
    return out
