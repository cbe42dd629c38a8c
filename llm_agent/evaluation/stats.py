"""Statistics over evaluated dialogues: bootstrap intervals of every dialogue metric and paired tests.

Every metric value comes from `llm_agent.metrics` (the one definition); this module only decides which records it
sees and how often. Intervals are percentile bootstrap intervals over dialogues: resample the N records with
replacement `n_resamples` times (numpy's `default_rng(seed)`), compute every metric on each resample, and take
the `(1 - confidence) / 2` and `(1 + confidence) / 2` quantiles (numpy's default linear interpolation). A resample
is a vector of counts (how often each record was drawn) and each metric is a ratio of per-record sums
(`llm_agent.metrics.MetricParts`), so all resamples are two matrix products, with exactly the values a loop over
resampled record lists would give. A metric whose definition excludes some records (error dialogues, ATT over
completed ones) is resampled through those same records, so its interval reflects that definition.

A metric can be undefined on a resample (ATT on a resample without a completed call): such resamples are skipped
for that metric, and its `Interval.resamples` says over how many the quantiles were taken, so displays can say
so. A metric undefined on all the records has no value and no interval (`Interval.value` is None).

For two agents evaluated on the same profiles, records are paired by dialogue id and profile (`pair_records`).
The CR difference gets a paired bootstrap interval (one index draw resamples both sides; a resample where either
side's CR is undefined is skipped) and McNemar's exact test: on pairs where neither dialogue is an `error`, b =
pairs only A completed, c = pairs only B completed, and the two-sided p-value is min(1, 2 * P[X <= min(b, c)]) for
X ~ Binomial(b + c, 1/2) (1 when b + c = 0).
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any, TypeVar

import numpy as np

from llm_agent.evaluation.defaults import DEFAULT_CONFIDENCE, DEFAULT_RESAMPLES
from llm_agent.metrics import MetricParts, metric_parts, record_label
from llm_agent.rollout.dialogue_record import DialogueRecord
from llm_agent.scenario import Scenario

__all__ = ["DEFAULT_CONFIDENCE", "DEFAULT_RESAMPLES", "Interval", "PairedComparison", "bootstrap_indices",
           "bootstrap_intervals", "mcnemar_exact", "metric_intervals", "paired_comparison", "pair_key",
           "pair_records"]

T = TypeVar("T")

_CHUNK_CELLS = 4_000_000  # resample counts held at once (resamples x records), about 32 MB of float64


@dataclass(frozen=True)
class Interval:
    """A point estimate on all records and its bootstrap interval [low, high] over `resamples` resamples (those
    on which the metric was defined). `value` is None when the metric is undefined on the records themselves;
    `low`/`high` are None when no resample (or none was drawn) defined it."""

    value: float | None
    low: float | None
    high: float | None
    resamples: int = 0

    @property
    def defined(self) -> bool:
        """True when the metric has a value on the records."""
        return self.value is not None

    def to_dict(self) -> dict[str, float | int | None]:
        """{"value", "low", "high", "resamples"} as plain numbers or null (the results.json form)."""
        return asdict(self)


def bootstrap_indices(n: int, n_resamples: int, seed: int) -> np.ndarray:
    """(n_resamples, n) indices drawn uniformly with replacement from range(n) by `default_rng(seed)`."""
    if n < 1:
        raise ValueError(f"bootstrap needs at least one dialogue, got {n}")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    return np.random.default_rng(seed).integers(0, n, size=(n_resamples, n))


def _counts(indices: np.ndarray, n: int) -> np.ndarray:
    """(R, n) how often each record occurs in each resample row of `indices` (R, n)."""
    rows = indices.shape[0]
    flat = (indices + n * np.arange(rows)[:, None]).ravel()
    return np.bincount(flat, minlength=rows * n).reshape(rows, n).astype(np.float64)


def _resampled_values(parts: MetricParts, indices: np.ndarray) -> dict[str, np.ndarray]:
    """{metric: value per resample (NaN where undefined)} for the resample `indices` (R, n), in chunks of rows."""
    n = len(parts)
    step = max(1, _CHUNK_CELLS // max(n, 1))
    chunks = [parts.values(_counts(indices[start:start + step], n)) for start in range(0, len(indices), step)]
    return {key: np.concatenate([c[key] for c in chunks]) for key in chunks[0]}


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")


def _interval(point: float | None, samples: np.ndarray, confidence: float) -> Interval:
    """The percentile interval of the finite `samples` (the resamples that define the metric)."""
    kept = samples[np.isfinite(samples)]
    if point is None or kept.size == 0:
        return Interval(point, None, None, int(kept.size))
    low, high = np.quantile(kept, [(1 - confidence) / 2, (1 + confidence) / 2])
    return Interval(point, float(low), float(high), int(kept.size))


def bootstrap_intervals(items: Sequence[T], statistic: Callable[[Sequence[T]], Mapping[str, float | None]],
                        n_resamples: int = DEFAULT_RESAMPLES, confidence: float = DEFAULT_CONFIDENCE,
                        seed: int = 0) -> dict[str, Interval | None]:
    """Every key of `statistic(items)` with its percentile bootstrap interval over `items` (resampled with
    `bootstrap_indices`). A key whose value on all items is None maps to None; a resample on which a key is None
    is left out of that key's quantiles."""
    _check_confidence(confidence)
    point = statistic(items)
    samples: dict[str, list[float]] = {key: [] for key, value in point.items() if value is not None}
    for rows in bootstrap_indices(len(items), n_resamples, seed):
        for key, value in statistic([items[i] for i in rows]).items():
            if key in samples and value is not None:
                samples[key].append(value)
    return {key: None if value is None else _interval(value, np.asarray(samples[key], dtype=np.float64), confidence)
            for key, value in point.items()}


def metric_intervals(records: Sequence[DialogueRecord], scenario: Scenario,
                     n_resamples: int = DEFAULT_RESAMPLES, confidence: float = DEFAULT_CONFIDENCE,
                     seed: int = 0) -> dict[str, Interval]:
    """Every key of `metric_keys(scenario)` with its percentile bootstrap interval over `records` (see module
    doc)."""
    _check_confidence(confidence)
    parts = metric_parts(records, scenario)
    point = parts.point()
    samples = _resampled_values(parts, bootstrap_indices(len(records), n_resamples, seed))
    return {key: _interval(point.get(key), values, confidence) for key, values in samples.items()}


def pair_key(record: DialogueRecord, where: str) -> tuple[str, str]:
    """(dialogue_id, the profile as canonical JSON): two evaluations' records pair when both match."""
    if not record.dialogue_id or not record.profile:
        raise ValueError(f"{where}: pairing needs a 'dialogue_id' and a 'profile', got {record.dialogue_id!r} and "
                         f"{record.profile!r}")
    return record.dialogue_id, json.dumps(record.profile, sort_keys=True)


def pair_records(records_a: Sequence[DialogueRecord], records_b: Sequence[DialogueRecord]
                 ) -> list[tuple[DialogueRecord, DialogueRecord]]:
    """The (a, b) record pairs with the same `pair_key`, in the order of `records_a`; ValueError on a key that
    occurs twice in one side (the pairing would be ambiguous)."""
    sides = []
    for name, records in (("A", records_a), ("B", records_b)):
        keyed: dict[tuple[str, str], DialogueRecord] = {}
        for i, record in enumerate(records):
            key = pair_key(record, f"agent {name} {record_label(record, i)}")
            if key in keyed:
                raise ValueError(f"agent {name}: dialogue {key[0]!r} with the same profile occurs twice")
            keyed[key] = record
        sides.append(keyed)
    return [(record, sides[1][key]) for key, record in sides[0].items() if key in sides[1]]


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for b and c discordant pairs (exact binomial with p = 1/2)."""
    if min(b, c) < 0:
        raise ValueError(f"discordant counts must be >= 0, got b={b}, c={c}")
    n = b + c
    if n == 0:
        return 1.0
    tail = Fraction(sum(math.comb(n, k) for k in range(min(b, c) + 1)), 2 ** n)
    return float(min(Fraction(1), 2 * tail))


@dataclass(frozen=True)
class PairedComparison:
    """CR of A minus CR of B on paired dialogues, its paired bootstrap interval and McNemar's exact test."""

    n_pairs: int
    cr_difference: Interval
    mcnemar_pairs: int
    only_a_completed: int
    only_b_completed: int
    mcnemar_p: float

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the interval as {"value", "low", "high"})."""
        out = asdict(self)
        out["cr_difference"] = self.cr_difference.to_dict()
        return out


def paired_comparison(records_a: Sequence[DialogueRecord], records_b: Sequence[DialogueRecord],
                      scenario: Scenario, n_resamples: int = DEFAULT_RESAMPLES,
                      confidence: float = DEFAULT_CONFIDENCE, seed: int = 0) -> PairedComparison | None:
    """Compare A and B on their common (dialogue id, profile) pairs; None when they share none."""
    _check_confidence(confidence)
    pairs = pair_records(records_a, records_b)
    if not pairs:
        return None
    parts_a = metric_parts([a for a, _ in pairs], scenario)
    parts_b = metric_parts([b for _, b in pairs], scenario)
    indices = bootstrap_indices(len(pairs), n_resamples, seed)
    diffs = (_resampled_values(parts_a, indices)["completion_rate"]
             - _resampled_values(parts_b, indices)["completion_rate"])
    cr_a, cr_b = parts_a.point().get("completion_rate"), parts_b.point().get("completion_rate")
    point = None if cr_a is None or cr_b is None else cr_a - cr_b
    outcomes = [(a.outcome, b.outcome) for a, b in pairs]
    scored = [(oa == "completed", ob == "completed") for oa, ob in outcomes if "error" not in (oa, ob)]
    only_a = sum(a and not b for a, b in scored)
    only_b = sum(b and not a for a, b in scored)
    return PairedComparison(n_pairs=len(pairs), cr_difference=_interval(point, diffs, confidence),
                            mcnemar_pairs=len(scored), only_a_completed=only_a, only_b_completed=only_b,
                            mcnemar_p=mcnemar_exact(only_a, only_b))
