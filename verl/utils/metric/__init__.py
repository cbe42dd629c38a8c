"""Metric reduction with veRL's names: `reduce_metrics` and the `Metric` accumulator (see `verl.utils.metric.utils`)."""

from verl.utils.metric.utils import AggregationType, Metric, reduce_metrics

__all__ = ["AggregationType", "Metric", "reduce_metrics"]
