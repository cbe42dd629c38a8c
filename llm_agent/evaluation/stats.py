"""Statistics over evaluated dialogues: bootstrap confidence intervals of every dialogue metric and paired tests.

Every metric value comes from `llm_agent.metrics.dialogue_metrics` (the one definition); this module only decides
which records it sees. Confidence intervals are percentile bootstrap intervals over dialogues: resample the N
records with replacement `n_resamples` times (numpy's `default_rng(seed)`), compute every metric on each
resample, and take the `(1 - confidence) / 2` and `(1 + confidence) / 2` quantiles (numpy's default linear
interpolation). A metric whose definition excludes some records (e.g. error dialogues, ATT over completed ones)
is resampled through those same records, so its interval reflects that definition.

For two agents evaluated on the same profiles, records are paired by dialogue id and profile (`pair_records`).
The CR difference gets a paired bootstrap interval (one index draw resamples both sides) and McNemar's exact
test: on pairs where neither dialogue is an `error`, b = pairs only A completed, c = pairs only B completed, and
the two-sided p-value is min(1, 2 * P[X <= min(b, c)]) for X ~ Binomial(b + c, 1/2) (1 when b + c = 0).
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any, TypeVar

import numpy as np

from llm_agent.metrics import dialogue_metrics, record_label, record_outcome
from llm_agent.scenario import Scenario

__all__ = ["Interval", "PairedComparison", "bootstrap_indices", "bootstrap_intervals", "mcnemar_exact",
           "metric_intervals", "paired_comparison", "pair_key", "pair_records"]

T = TypeVar("T")

DEFAULT_RESAMPLES = 1000
DEFAULT_CONFIDENCE = 0.95


@dataclass(frozen=True)
class Interval:
    """A point estimate on all records and its bootstrap interval [low, high]."""

    value: float
    low: float
    high: float

    def to_dict(self) -> dict[str, float]:
        """{"value", "low", "high"} as plain floats (the results.json form)."""
        return asdict(self)


def bootstrap_indices(n: int, n_resamples: int, seed: int) -> np.ndarray:
    """(n_resamples, n) indices drawn uniformly with replacement from range(n) by `default_rng(seed)`."""
    if n < 1:
        raise ValueError(f"bootstrap needs at least one dialogue, got {n}")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    return np.random.default_rng(seed).integers(0, n, size=(n_resamples, n))


def _quantiles(values: Sequence[float], confidence: float) -> tuple[float, float]:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    low, high = np.quantile(np.asarray(values, dtype=np.float64), [(1 - confidence) / 2, (1 + confidence) / 2])
    return float(low), float(high)


def bootstrap_intervals(items: Sequence[T], statistic: Callable[[Sequence[T]], Mapping[str, float | None]],
                        n_resamples: int = DEFAULT_RESAMPLES, confidence: float = DEFAULT_CONFIDENCE,
                        seed: int = 0) -> dict[str, Interval | None]:
    """Every key of `statistic(items)` with its percentile bootstrap interval over `items` (resampled with
    `bootstrap_indices`). A key whose value on all items is None maps to None; a resample on which a key is None
    is left out of that key's quantiles."""
    point = statistic(items)
    samples: dict[str, list[float]] = {key: [] for key, value in point.items() if value is not None}
    for rows in bootstrap_indices(len(items), n_resamples, seed):
        for key, value in statistic([items[i] for i in rows]).items():
            if key in samples and value is not None:
                samples[key].append(value)
    return {key: None if value is None else Interval(value, *_quantiles(samples[key] or [value], confidence))
            for key, value in point.items()}


def metric_intervals(records: Sequence[Mapping[str, Any]], scenario: Scenario,
                     n_resamples: int = DEFAULT_RESAMPLES, confidence: float = DEFAULT_CONFIDENCE,
                     seed: int = 0) -> dict[str, Interval]:
    """Every key of `dialogue_metrics` with its percentile bootstrap interval over `records` (see module doc)."""
    return bootstrap_intervals(records, lambda rows: dialogue_metrics(rows, scenario), n_resamples, confidence, seed)


def pair_key(record: Mapping[str, Any], where: str) -> tuple[str, str]:
    """(dialogue_id, the profile as canonical JSON): two evaluations' records pair when both match."""
    dialogue_id, profile = record.get("dialogue_id"), record.get("profile")
    if not isinstance(dialogue_id, str) or not isinstance(profile, Mapping):
        raise ValueError(f"{where}: pairing needs a string 'dialogue_id' and a dict 'profile', got "
                         f"{dialogue_id!r} and {type(profile).__name__}")
    return dialogue_id, json.dumps(profile, sort_keys=True)


def pair_records(records_a: Sequence[Mapping[str, Any]], records_b: Sequence[Mapping[str, Any]]
                 ) -> list[tuple[Mapping[str, Any], Mapping[str, Any]]]:
    """The (a, b) record pairs with the same `pair_key`, in the order of `records_a`; ValueError on a key that
    occurs twice in one side (the pairing would be ambiguous)."""
    sides = []
    for name, records in (("A", records_a), ("B", records_b)):
        keyed: dict[tuple[str, str], Mapping[str, Any]] = {}
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


def paired_comparison(records_a: Sequence[Mapping[str, Any]], records_b: Sequence[Mapping[str, Any]],
                      scenario: Scenario, n_resamples: int = DEFAULT_RESAMPLES,
                      confidence: float = DEFAULT_CONFIDENCE, seed: int = 0) -> PairedComparison | None:
    """Compare A and B on their common (dialogue id, profile) pairs; None when they share none."""
    pairs = pair_records(records_a, records_b)
    if not pairs:
        return None
    side_a, side_b = [a for a, _ in pairs], [b for _, b in pairs]

    def cr(records: Sequence[Mapping[str, Any]]) -> float:
        return dialogue_metrics(records, scenario)["completion_rate"]

    diffs = [cr([side_a[i] for i in rows]) - cr([side_b[i] for i in rows])
             for rows in bootstrap_indices(len(pairs), n_resamples, seed)]
    outcomes = [(record_outcome(a, f"agent A {record_label(a, i)}"), record_outcome(b, f"agent B {record_label(b, i)}"))
                for i, (a, b) in enumerate(pairs)]
    scored = [(oa == "completed", ob == "completed") for oa, ob in outcomes if "error" not in (oa, ob)]
    only_a = sum(a and not b for a, b in scored)
    only_b = sum(b and not a for a, b in scored)
    return PairedComparison(n_pairs=len(pairs),
                            cr_difference=Interval(cr(side_a) - cr(side_b), *_quantiles(diffs, confidence)),
                            mcnemar_pairs=len(scored), only_a_completed=only_a, only_b_completed=only_b,
                            mcnemar_p=mcnemar_exact(only_a, only_b))
