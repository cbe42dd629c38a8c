"""Data series for the plots, taken from per-step metric dicts (`run_data.read_step_metrics`).

Everything here is plain numbers: which steps hold a key, smoothing, the outcome mix as shares of all
dialogues, and the (value x step) matrices of the controller's weights and per-value completion rates.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["OUTCOME_RATE_KEYS", "cache_stage_series", "controller_matrix", "ema", "metric_series", "outcome_mix",
           "present_keys"]

# outcome -> its rate among non-error dialogues in llm_agent.metrics (error_rate is over all dialogues)
OUTCOME_RATE_KEYS: dict[str, str] = {"completed": "completion_rate", "hung_up": "hang_up_rate",
                                     "agent_ended": "agent_ended_rate", "timeout": "timeout_rate",
                                     "truncated": "truncated_rate", "error": "error_rate"}


def present_keys(rows: Sequence[Mapping[str, float]]) -> set[str]:
    """Every metric key that appears in at least one row."""
    return {k for row in rows for k in row}


def metric_series(rows: Sequence[Mapping[str, float]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the rows that hold `key`, in row order."""
    pairs = [(row["step"], row[key]) for row in rows if key in row]
    if not pairs:
        return np.empty(0), np.empty(0)
    steps, values = zip(*pairs)
    return np.asarray(steps, dtype=float), np.asarray(values, dtype=float)


def ema(values: Sequence[float], weight: float) -> np.ndarray:
    """Debiased exponential moving average (TensorBoard's smoothing): weight 0 returns the values unchanged.

    s_t = weight * s_{t-1} + (1 - weight) * x_t from s_0 = 0, divided by 1 - weight**(t+1).
    """
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
    out = np.empty(len(values))
    last = 0.0
    for i, x in enumerate(values):
        last = weight * last + (1.0 - weight) * float(x)
        out[i] = last / (1.0 - weight ** (i + 1))
    return out


def outcome_mix(rows: Sequence[Mapping[str, float]], prefix: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(steps, {outcome: share of all dialogues}) from the `<prefix><rate>` keys; the shares sum to 1.

    The non-error outcome rates are over non-error dialogues, so each is scaled by (1 - error_rate). Steps
    missing any rate key are left out; an empty result when no step has them all.
    """
    keys = {o: prefix + k for o, k in OUTCOME_RATE_KEYS.items()}
    usable = [row for row in rows if all(k in row for k in keys.values())]
    steps = np.asarray([row["step"] for row in usable], dtype=float)
    shares: dict[str, np.ndarray] = {}
    errors = np.asarray([row[keys["error"]] for row in usable], dtype=float)
    for outcome, key in keys.items():
        values = np.asarray([row[key] for row in usable], dtype=float)
        shares[outcome] = values if outcome == "error" else values * (1.0 - errors)
    return steps, shares


def _sort_label(label: str) -> tuple[int, float | str]:
    try:
        return 0, float(label)
    except ValueError:
        return 1, label


def controller_matrix(rows: Sequence[Mapping[str, float]], prefix: str, dim: str
                      ) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(value labels, steps, matrix[value, step]) of the keys `<prefix><dim>=<value>` (e.g. prefix
    "controller/weight/"); NaN where a step lacks a value. Empty when no row has such a key."""
    pattern = re.compile(re.escape(prefix + dim + "=") + r"(-?\d+)$")
    labels = sorted({m.group(1) for row in rows for k in row if (m := pattern.match(k))}, key=_sort_label)
    used = [row for row in rows if any(f"{prefix}{dim}={v}" in row for v in labels)]
    steps = np.asarray([row["step"] for row in used], dtype=float)
    matrix = np.full((len(labels), len(used)), np.nan)
    for j, row in enumerate(used):
        for i, v in enumerate(labels):
            matrix[i, j] = row.get(f"{prefix}{dim}={v}", np.nan)
    return labels, steps, matrix


def cache_stage_series(rows: Sequence[Mapping[str, float]]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{stage label: (steps, hit rate)} from `cache/hit_rate/stage<id>`; steps where the stage had no eligible
    lookup (`cache/eligible/stage<id>` == 0) are dropped, since their rate of 0 means "not asked"."""
    pattern = re.compile(r"cache/hit_rate/stage(-?\d+)$")
    stages = sorted({m.group(1) for row in rows for k in row if (m := pattern.match(k))}, key=_sort_label)
    out = {}
    for stage in stages:
        rate_key, eligible_key = f"cache/hit_rate/stage{stage}", f"cache/eligible/stage{stage}"
        kept = [(row["step"], row[rate_key]) for row in rows
                if rate_key in row and row.get(eligible_key, 1.0) > 0]
        steps, values = (zip(*kept) if kept else ((), ()))
        out[f"stage {stage}"] = (np.asarray(steps, dtype=float), np.asarray(values, dtype=float))
    return out
