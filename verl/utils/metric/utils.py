"""Reducing lists of per-micro-batch / per-rank metric values to one number each (veRL's rules and names).

`reduce_metrics` takes the max of a list whose key contains "max", the min of one whose key contains "min",
and the mean otherwise (veRL's rule: `response_length/max` over ranks is the largest of them); a `Metric`
value is reduced by its own aggregation. `Metric` collects scalars with a declared aggregation (mean, sum, min,
max) and combines the lists of several data-parallel ranks (`aggregate_dp`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import Enum
from typing import Any

import numpy as np
import torch

__all__ = ["AggregationType", "Metric", "reduce_metrics"]


class AggregationType(Enum):
    """How a `Metric`'s values are combined into one number."""

    MEAN = "mean"
    SUM = "sum"
    MIN = "min"
    MAX = "max"


_REDUCERS = {AggregationType.MEAN: np.mean, AggregationType.SUM: np.sum, AggregationType.MIN: np.min,
             AggregationType.MAX: np.max}  # fmt: skip


def _as_number(value: Any) -> float | int:
    """A scalar (int, float, numpy scalar, one-element tensor or array) as a Python number; ValueError otherwise."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if value.size != 1 if isinstance(value, np.ndarray) else value.numel() != 1:
            raise ValueError(f"metric values must be scalars, got a tensor/array of shape {tuple(value.shape)}")
        return value.item()
    if isinstance(value, (bool, int, float, np.integer, np.floating)):
        return value.item() if isinstance(value, np.generic) else value
    raise ValueError(f"metric values must be numbers, got {type(value).__name__}: {value!r}")


class Metric:
    """Scalars collected under one aggregation (`"mean"`, `"sum"`, `"min"`, `"max"` or an `AggregationType`)."""

    def __init__(self, aggregation: str | AggregationType, value: Any = None) -> None:
        try:
            self.aggregation = AggregationType(aggregation)
        except ValueError:
            raise ValueError(
                f"Metric: unsupported aggregation {aggregation!r}; expected one of {[a.value for a in AggregationType]}"
            ) from None
        self.values: list[float | int] = []
        if value is not None:
            self.extend(value) if isinstance(value, (list, tuple)) else self.append(value)

    def __repr__(self) -> str:
        return f"Metric({self.aggregation.value}, {len(self.values)} values)"

    def append(self, value: Any) -> None:
        """Add one scalar (a scalar tensor is converted to a number), or all values of another `Metric`."""
        if isinstance(value, Metric):
            self.extend(value)
        else:
            self.values.append(_as_number(value))

    def extend(self, values: Metric | Iterable[Any]) -> None:
        """Add several scalars, or all values of another `Metric` with the same aggregation."""
        if isinstance(values, Metric):
            if values.aggregation is not self.aggregation:
                raise ValueError(
                    f"Metric.extend: aggregation mismatch: {self.aggregation.value} != {values.aggregation.value}"
                )
            values = values.values
        for value in values:
            self.append(value)

    def aggregate(self) -> float:
        """The values combined by this metric's aggregation (NaN for no values, as numpy gives for a mean)."""
        return self._aggregate(self.values, self.aggregation)

    @staticmethod
    def _aggregate(values: Any, aggregation: AggregationType) -> float:
        if len(values) == 0:
            return 0.0 if aggregation is AggregationType.SUM else float("nan")
        return float(_REDUCERS[aggregation](values))

    @classmethod
    def aggregate_dp(cls, metric_lists: list[Metric]) -> float:
        """Combine one `Metric` per data-parallel rank, each with the same number of values.

        SUM and MEAN: average position by position over the ranks, then sum/mean (so a per-rank share of a
        loss sums to the whole); MIN and MAX: over all values of all ranks.
        """
        if not metric_lists:
            raise ValueError("Metric.aggregate_dp: needs at least one Metric")
        lengths = [len(metric.values) for metric in metric_lists]
        if len(set(lengths)) != 1:
            raise ValueError(f"Metric.aggregate_dp: every rank needs the same number of values, got {lengths}")
        aggregation = metric_lists[0].aggregation
        values = np.array([metric.values for metric in metric_lists], dtype=np.float64)
        if aggregation in (AggregationType.SUM, AggregationType.MEAN):
            return cls._aggregate(values.mean(axis=0), aggregation)
        return cls._aggregate(values.ravel(), aggregation)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], aggregation: str | AggregationType) -> dict[str, Metric]:
        """One `Metric` per key, holding that key's value(s)."""
        return {key: cls(aggregation=aggregation, value=value) for key, value in data.items()}

    def init_list(self) -> Metric:
        """A new empty `Metric` with the same aggregation."""
        return Metric(aggregation=self.aggregation)


def _reducer_for(key: str) -> AggregationType:
    """veRL's rule: max when the key contains "max", else min when it contains "min", else mean."""
    if "max" in key:
        return AggregationType.MAX
    if "min" in key:
        return AggregationType.MIN
    return AggregationType.MEAN


def reduce_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """One number per metric: a `Metric` by its aggregation; a list (or tensor) by the key rule (max for keys
    containing "max", min for "min", mean otherwise; an empty list gives NaN); a scalar as is.

    Returns a new dict; `metrics` is not modified.
    """
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, Metric):
            out[key] = value.aggregate()
        elif isinstance(value, (list, tuple)):
            out[key] = Metric._aggregate([_as_number(v) for v in value], _reducer_for(key))
        elif isinstance(value, (torch.Tensor, np.ndarray)):
            array = value.detach().float().cpu().numpy() if isinstance(value, torch.Tensor) else value
            out[key] = Metric._aggregate(np.asarray(array, dtype=np.float64).ravel(), _reducer_for(key))
        else:
            out[key] = float(_as_number(value))
    return out
