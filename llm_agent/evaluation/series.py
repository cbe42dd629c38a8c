"""Data series for the plots, taken from per-step metric dicts (`run_data.read_step_metrics`).

Everything here is plain numbers: which steps hold a key, smoothing, the outcome mix as shares of all
dialogues, and the (value x step) matrices of the controller's weights and per-value completion rates.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["OUTCOME_RATE_KEYS", "cache_stage_series", "cache_targets", "controller_matrix", "ema", "metric_series", "outcome_mix",
           "present_keys"]

# outcome -> its rate among non-error dialogues in llm_agent.metrics (error_rate is over all dialogues)
OUTCOME_RATE_KEYS: dict[str, str] = {"completed": "completion_rate", "hung_up": "hang_up_rate",
                                     "agent_ended": "agent_ended_rate", "timeout": "timeout_rate",
                                     "truncated": "truncated_rate", "error": "error_rate"}


def present_keys(rows: Sequence[Mapping[str, float]]) -> set[str]:
    """Every metric key that appears in at least one row."""
    return {k for row in rows for k in row}


def _namespace(key: str) -> str:
    return key.rsplit("/", 1)[0] + "/" if "/" in key else ""


def metric_series(rows: Sequence[Mapping[str, float]], key: str, undefined_as_nan: bool = False
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the rows that hold `key`, in row order. With `undefined_as_nan`, a row that lacks `key`
    but holds other metrics of its namespace (`dialogue/att` missing beside `dialogue/adt`: the metric was
    undefined at that step, e.g. no call completed) gives NaN, so a line shows a gap there instead of joining its
    neighbours."""
    namespace = _namespace(key)
    pairs = []
    for row in rows:
        if key in row:
            pairs.append((row["step"], row[key]))
        elif undefined_as_nan and namespace and any(k.startswith(namespace) for k in row):
            pairs.append((row["step"], float("nan")))
    if not pairs or all(np.isnan(v) for _, v in pairs):
        return np.empty(0), np.empty(0)
    steps, values = zip(*pairs)
    return np.asarray(steps, dtype=float), np.asarray(values, dtype=float)


def ema(values: Sequence[float], weight: float) -> np.ndarray:
    """Debiased exponential moving average (TensorBoard's smoothing): weight 0 returns the values unchanged.

    s_t = weight * s_{t-1} + (1 - weight) * x_t from s_0 = 0, divided by 1 - weight**t after t values; NaN values
    (undefined points) are skipped and stay NaN.
    """
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
    out = np.full(len(values), np.nan)
    last, seen = 0.0, 0
    for i, x in enumerate(values):
        if not np.isfinite(x):
            continue
        seen += 1
        last = weight * last + (1.0 - weight) * float(x)
        out[i] = last / (1.0 - weight ** seen)
    return out


def outcome_mix(rows: Sequence[Mapping[str, float]], prefix: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(steps, {outcome: share of all dialogues}) from the `<prefix><rate>` keys; the shares sum to 1.

    The non-error outcome rates are over non-error dialogues, so each is scaled by (1 - error_rate); a step where
    every dialogue failed is all error. Steps missing any rate key are left out; an empty result when no step has
    them all.
    """
    keys = {o: prefix + k for o, k in OUTCOME_RATE_KEYS.items()}
    # a step whose dialogues all failed has only the error rate (the other rates are undefined): all error
    rows = [{**{k: 0.0 for k in keys.values()}, **row} if row.get(keys["error"]) == 1.0 else row for row in rows]
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


def cache_targets(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """{stage label: the configured hit rate} from the last `cache/target_hit_rate/stage<id>` of each stage."""
    pattern = re.compile(r"cache/target_hit_rate/stage(-?\d+)$")
    return {f"stage {m.group(1)}": float(value) for row in rows for key, value in row.items()
            if (m := pattern.match(key))}


def cache_stage_series(rows: Sequence[Mapping[str, float]]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{stage label: (steps, hit rate)} from `cache/hit_rate/stage<id>`; steps where the stage had no eligible
    lookup are dropped (the rate is undefined: left out of the metrics, or 0 with `cache/eligible/stage<id>` == 0
    in logs written before)."""
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
