"""An independent float64 reference of rollout correction for the tests: plain Python loops over rows, units
and tokens (no torch maths), written from the definitions in README ("Rollout correction") and veRL 0.9.x's
documentation. Inputs are nested lists (or tensors, converted); a row's units are its loss tokens (token), its
agent turns (turn) or all of its loss tokens (sequence). Also the tests' random dialogue-shaped inputs and
their metric comparison."""
from __future__ import annotations

import math
import statistics
from typing import Optional

import pytest
import torch

BOUND = 20.0


def _rows(x) -> list[list[float]]:
    return x.double().tolist() if hasattr(x, "tolist") else [list(map(float, r)) for r in x]


def _clip(v: float) -> float:
    return max(-BOUND, min(BOUND, v))


def units_of_row(mask_row: list[float], turn_row: Optional[list[int]], level: str) -> list[list[int]]:
    """Positions of each unit of one row, in order."""
    tokens = [t for t, m in enumerate(mask_row) if m != 0]
    if level == "token":
        return [[t] for t in tokens]
    if level == "sequence":
        return [tokens] if tokens else []
    if turn_row is None:  # runs of consecutive loss tokens
        runs: list[list[int]] = []
        for t in tokens:
            if runs and runs[-1][-1] == t - 1:
                runs[-1].append(t)
            else:
                runs.append([t])
        return runs
    groups: dict[int, list[int]] = {}
    for t in tokens:
        groups.setdefault(int(turn_row[t]), []).append(t)
    return [groups[k] for k in sorted(groups)]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _std(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def _token_std(values: list[float], low: float, high: float) -> float:
    if len(values) <= 1:
        return 0.0
    clipped = [min(max(v, low), high) for v in values]
    return math.sqrt(max(_mean([c * c for c in clipped]) - _mean(clipped) ** 2, 0.0))


def weights(log_ratio, mask, level: str, upper: float, lower: Optional[float] = None, normalize: bool = False,
            turn_ids=None) -> tuple[list[list[float]], dict[str, float]]:
    """Applied IS weights (rows of floats) and the rollout_is_* metrics."""
    lr, m = _rows(log_ratio), _rows(mask)
    turns = None if turn_ids is None else turn_ids.tolist()
    n_rows, length = len(lr), len(lr[0])
    applied = [[0.0] * length for _ in range(n_rows)]
    raw = [[0.0] * length for _ in range(n_rows)]
    unit_logs, unit_applied = [], []
    for i in range(n_rows):
        for unit in units_of_row(m[i], None if turns is None else turns[i], level):
            total = sum(lr[i][t] for t in unit)
            r = math.exp(_clip(total))
            a = min(r, upper) if lower is None else (r if lower <= r <= upper else 0.0)
            unit_logs.append(total)
            unit_applied.append(a)
            for t in unit:
                raw[i][t], applied[i][t] = r, a
    tok = [(i, t) for i in range(n_rows) for t in range(length) if m[i][t] != 0]
    w_tok = [applied[i][t] for i, t in tok]
    raw_tok = [raw[i][t] for i, t in tok]
    low = 1.0 / upper if lower is None else lower
    out = {"rollout_is_mean": _mean(w_tok)}
    if level == "token":
        out["rollout_is_ratio_fraction_high"] = _mean([float(r > upper) for r in raw_tok])
        out["rollout_is_ratio_fraction_low"] = _mean([float(r < low) for r in raw_tok])
        out["rollout_is_max"], out["rollout_is_min"] = max(w_tok), min(w_tok)
    else:
        out["rollout_is_max"] = math.exp(min(max(unit_logs), BOUND))
        out["rollout_is_min"] = math.exp(min(unit_logs))
        out["rollout_is_ratio_fraction_high"] = _mean([float(x > math.log(upper)) for x in unit_logs])
        out["rollout_is_ratio_fraction_low"] = _mean([float(x < math.log(low)) for x in unit_logs])
    out["rollout_is_std"] = _token_std(w_tok, 0.0, upper)
    bounded = [min(max(w, 0.0), upper) for w in w_tok]
    mean_bounded = _mean(bounded)
    out["rollout_is_eff_sample_size"] = 1.0 / _mean([(b / (mean_bounded + 1e-8)) ** 2 for b in bounded])
    rows = [i for i in range(n_rows) if any(v != 0 for v in m[i])]
    seq = [_mean([applied[i][t] for t in range(length) if m[i][t] != 0]) for i in rows]
    raw_seq = [_mean([raw[i][t] for t in range(length) if m[i][t] != 0]) for i in rows]
    out.update({"rollout_is_seq_mean": _mean(seq), "rollout_is_seq_std": _std(seq), "rollout_is_seq_max": max(seq),
                "rollout_is_seq_min": min(seq), "rollout_is_seq_max_deviation": max(abs(s - 1.0) for s in seq),
                "rollout_is_seq_fraction_high": _mean([float(s > upper) for s in raw_seq]),
                "rollout_is_seq_fraction_low": _mean([float(s < low) for s in raw_seq])})
    if lower is not None:
        out["rollout_is_oob_ratio"] = _mean([float(r < lower or r > upper) for r in raw_tok])
    if normalize:
        mean = _mean(w_tok) if level == "token" else _mean(unit_applied)
        factor = mean if mean > 1e-8 else 1.0
        applied = [[a / factor for a in row] for row in applied]
        out["rollout_is_batch_norm_factor"] = factor
    return applied, out


def _estimate(name: str, log_ratio: float) -> float:
    x = _clip(log_ratio)
    return {"k1": -x, "k2": 0.5 * x * x, "k3": math.exp(x) - 1.0 - x}[name]


def _bounds(estimator: str, spec: str) -> tuple[Optional[float], float]:
    if estimator != "k1":
        return None, float(spec)
    if "_" in spec:
        lo, hi = spec.split("_")
        return math.log(float(lo)), math.log(float(hi))
    return math.log(1.0 / float(spec)), math.log(float(spec))


def rejection(log_ratio, mask, options: list[tuple[str, str]], turn_ids=None) -> tuple[list[list[float]], dict]:
    """The mask after rejection and the rollout_rs_* metrics; ``options`` are (name, threshold spec) pairs."""
    lr, m = _rows(log_ratio), _rows(mask)
    turns = None if turn_ids is None else turn_ids.tolist()
    n_rows, length = len(lr), len(lr[0])
    tok = [(i, t) for i in range(n_rows) for t in range(length) if m[i][t] != 0]
    rows = [i for i in range(n_rows) if any(v != 0 for v in m[i])]
    rejected_any: set[tuple[int, int]] = set()
    out: dict[str, float] = {}
    for name, spec in options:
        parts = name.split("_")
        level = {"token": "token", "seq": "sequence", "turn": "turn"}[parts[0]]
        estimator = parts[-1]
        lo, hi = _bounds(estimator, spec)
        stat = [[0.0] * length for _ in range(n_rows)]
        unit_stats, turn_rejected = [], []
        for i in range(n_rows):
            unit_level = "token" if level == "token" else level
            for unit in units_of_row(m[i], None if turns is None else turns[i], unit_level):
                values = [_estimate(estimator, lr[i][t]) for t in unit]
                value = values[0] if level == "token" else {"sum": sum, "mean": _mean, "max": max}[parts[1]](values)
                unit_stats.append(value)
                keep = value <= hi and (lo is None or value >= lo)
                turn_rejected.append(not keep)
                for t in unit:
                    stat[i][t] = value
                    if not keep:
                        rejected_any.add((i, t))
        rejected_here = {(i, t) for i, t in tok if not (stat[i][t] <= hi and (lo is None or stat[i][t] >= lo))}
        p = f"rollout_rs_{name}"
        high, low = hi, (lo if estimator == "k1" else 0.0)
        tok_stat = [stat[i][t] for i, t in tok]
        out[f"{p}_mean"] = _mean(tok_stat)
        units = tok_stat if level == "token" else unit_stats
        out[f"{p}_max"], out[f"{p}_min"] = max(units), min(units)
        out[f"{p}_fraction_high"] = _mean([float(u > high) for u in units])
        out[f"{p}_fraction_low"] = _mean([float(u < low) for u in units]) if estimator == "k1" else 0.0
        out[f"{p}_std"] = _token_std(tok_stat, low, high)
        row_values = [_mean([stat[i][t] for t in range(length) if m[i][t] != 0]) for i in rows]
        out.update({f"{p}_seq_mean": _mean(row_values), f"{p}_seq_std": _std(row_values),
                    f"{p}_seq_max": max(row_values), f"{p}_seq_min": min(row_values),
                    f"{p}_seq_max_deviation": max(abs(v) for v in row_values),
                    f"{p}_seq_fraction_high": _mean([float(v > high) for v in row_values])})
        if estimator == "k1":
            out[f"{p}_seq_fraction_low"] = _mean([float(v < low) for v in row_values])
        out[f"{p}_masked_fraction"] = len(rejected_here) / len(tok)
        out[f"{p}_seq_masked_fraction"] = _mean([float(any((i, t) in rejected_here for t in range(length)))
                                                 for i in rows])
        if level == "turn":
            out[f"{p}_turn_masked_fraction"] = _mean([float(r) for r in turn_rejected])
    out["rollout_rs_masked_fraction"] = len(rejected_any) / len(tok)
    out["rollout_rs_seq_masked_fraction"] = _mean([float(any((i, t) in rejected_any for t in range(length)))
                                                   for i in rows])
    new_mask = [[0.0 if (i, t) in rejected_any or m[i][t] == 0 else m[i][t] for t in range(length)]
                for i in range(n_rows)]
    return new_mask, out


def offpolicy(old, rollout, mask) -> dict[str, float]:
    """veRL's off-policy metrics over the rows that have loss tokens."""
    o, r, m = _rows(old), _rows(rollout), _rows(mask)
    rows = [[t for t, v in enumerate(row) if v != 0] for row in m]
    rows = [(i, ts) for i, ts in enumerate(rows) if ts]
    tok = [(i, t) for i, ts in rows for t in ts]
    train_mean = [_mean([o[i][t] for t in ts]) for i, ts in rows]
    roll_mean = [_mean([r[i][t] for t in ts]) for i, ts in rows]
    diffs = [b - a for a, b in zip(train_mean, roll_mean)]
    ratios = [o[i][t] - r[i][t] for i, t in tok]
    seq_sums = [_clip(sum(o[i][t] - r[i][t] for t in ts)) for i, ts in rows]
    return {"training_ppl": _mean([math.exp(-x) for x in train_mean]), "training_log_ppl": _mean([-x for x in train_mean]),
            "kl": _mean([-x for x in ratios]), "k3_kl": _mean([math.exp(x) - x - 1 for x in ratios]),
            "rollout_ppl": _mean([math.exp(-x) for x in roll_mean]), "rollout_log_ppl": _mean([-x for x in roll_mean]),
            "log_ppl_diff": _mean(diffs), "log_ppl_abs_diff": _mean([abs(d) for d in diffs]),
            "log_ppl_diff_max": max(diffs), "log_ppl_diff_min": min(diffs),
            "ppl_ratio": _mean([math.exp(d) for d in diffs]),
            "chi2_token": _mean([math.exp(_clip(x)) ** 2 for x in ratios]) - 1.0,
            "chi2_seq": _mean([math.exp(2 * s) for s in seq_sums]) - 1.0}


def dialogue_batch(seed: int, rows: int = 12, length: int = 40, dtype=torch.float64, scale: float = 0.2,
                   masked_value: float = float("nan")):
    """(old, rollout, mask): 1-5 agent turns per row separated by user turns, padding after; row 1 has no loss
    token; positions outside the mask hold ``masked_value`` in both log-prob tensors."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, length, generator=gen, dtype=torch.float64) * 4
    rollout = old + torch.randn(rows, length, generator=gen, dtype=torch.float64) * scale
    mask = torch.zeros(rows, length)
    for i in range(rows):
        pos = int(torch.randint(0, 3, (1,), generator=gen))
        for _ in range(int(torch.randint(1, 6, (1,), generator=gen))):
            run = int(torch.randint(1, 7, (1,), generator=gen))
            mask[i, pos:pos + run] = 1
            pos += run + int(torch.randint(1, 4, (1,), generator=gen))
    mask[1] = 0
    outside = mask == 0
    old, rollout = old.masked_fill(outside, masked_value), rollout.masked_fill(outside, masked_value)
    return old.to(dtype), rollout.to(dtype), mask


def assert_metrics_match(got: dict, expected: dict, rel: float = 1e-7):
    """The same metric names, every value within ``rel`` (or 1e-9 absolute)."""
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=rel, abs=1e-9), key
