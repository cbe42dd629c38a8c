"""Validation metrics over several responses per prompt (veRL's names): bootstrap estimates of best/worst/majority
of k responses, averaged per data source. Re-exported by :mod:`verl.trainer.ppo.metric_utils`. Also the text rows of
the validation samples the trainer logs (``trainer.log_val_generations``)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["bootstrap_metric", "calc_maj_val", "generation_rows", "process_validation_metrics"]


def bootstrap_metric(
    data: Sequence[Any],
    subset_size: int,
    reduce_fns: Sequence[Callable[[np.ndarray], float]],
    n_bootstrap: int = 1000,
    seed: int = 42,
) -> list[tuple[float, float]]:
    """(mean, std) over `n_bootstrap` resamples (with replacement, `subset_size` items each) of every reduce_fn.

    Deterministic for a given `seed` (a private generator; the global numpy seed is untouched).
    """
    if len(data) == 0:
        raise ValueError("bootstrap_metric: data is empty")
    if subset_size < 1:
        raise ValueError(f"bootstrap_metric: subset_size must be >= 1, got {subset_size}")
    items = np.empty(len(data), dtype=object)
    items[:] = list(data)
    picks = np.random.default_rng(seed).integers(0, len(data), size=(n_bootstrap, subset_size))
    results = []
    for reduce_fn in reduce_fns:
        values = np.array([reduce_fn(items[rows]) for rows in picks], dtype=np.float64)
        results.append((float(values.mean()), float(values.std())))
    return results


def calc_maj_val(data: Sequence[Mapping[str, Any]], vote_key: str, val_key: str) -> Any:
    """`val_key` of the first item voting for the most common `vote_key` (ties: the vote seen first)."""
    if len(data) == 0:
        raise ValueError("calc_maj_val: data is empty")
    counts: dict[Hashable, int] = defaultdict(int)
    first_val: dict[Hashable, Any] = {}
    for item in data:
        counts[item[vote_key]] += 1
        first_val.setdefault(item[vote_key], item[val_key])
    majority = max(counts, key=counts.__getitem__)
    return first_val[majority]


def _subset_sizes(n: int) -> list[int]:
    """2, 4, 8, ... below n, then n itself (empty for n <= 1)."""
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return sizes + [n] if n > 1 else []


def _prompt_metrics(values: list[Any], preds: list[Any] | None, seed: int) -> dict[str, float]:
    """mean@n, std@n and for each subset size k: best@k, worst@k (and maj@k with predictions), mean and std."""
    n = len(values)
    metrics = {f"mean@{n}": float(np.mean(values))}
    if n == 1:
        return metrics
    metrics[f"std@{n}"] = float(np.std(values))
    votes = None if preds is None else [{"val": v, "pred": p} for v, p in zip(values, preds)]
    for k in _subset_sizes(n):
        (best, best_std), (worst, worst_std) = bootstrap_metric(values, k, [np.max, np.min], seed=seed)
        metrics.update({f"best@{k}/mean": best, f"best@{k}/std": best_std,
                        f"worst@{k}/mean": worst, f"worst@{k}/std": worst_std})  # fmt: skip
        if votes is not None:
            [(maj, maj_std)] = bootstrap_metric(
                votes, k, [lambda rows: calc_maj_val(rows, vote_key="pred", val_key="val")], seed=seed
            )
            metrics.update({f"maj@{k}/mean": maj, f"maj@{k}/std": maj_std})
    return metrics


def process_validation_metrics(
    data_sources: Sequence[str], sample_inputs: Sequence[Hashable], infos_dict: Mapping[str, Sequence[Any]],
    seed: int = 42,
) -> dict[str, dict[str, dict[str, float]]]:
    """`{data_source: {variable: {metric: value}}}`: per prompt (`sample_inputs`), the metrics of each numeric
    variable over its responses (see `_prompt_metrics`; a `pred` variable enables maj@k), averaged over the
    prompts of each data source. String-valued variables are skipped."""
    for name, values in infos_dict.items():
        if len(values) != len(data_sources):
            raise ValueError(f"process_validation_metrics: {name!r} has {len(values)} values for "
                             f"{len(data_sources)} samples")
    if len(sample_inputs) != len(data_sources):
        raise ValueError("process_validation_metrics: sample_inputs and data_sources differ in length")
    grouped: dict[str, dict[Hashable, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, (source, prompt) in enumerate(zip(data_sources, sample_inputs)):
        grouped[source][prompt].append(i)
    result: dict[str, dict[str, dict[str, float]]] = {}
    for source, prompts in grouped.items():
        per_metric: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for rows in prompts.values():
            preds = [infos_dict["pred"][i] for i in rows] if "pred" in infos_dict else None
            for name, all_values in infos_dict.items():
                values = [all_values[i] for i in rows]
                if isinstance(values[0], str):
                    continue
                for metric, value in _prompt_metrics(values, preds, seed).items():
                    per_metric[name][metric].append(value)
        result[source] = {name: {metric: float(np.mean(v)) for metric, v in metrics.items()}
                          for name, metrics in per_metric.items()}  # fmt: skip
    return result


def generation_rows(tokenizer: Any, batches: Sequence[Any], scores: Sequence[float], limit: int) -> list[list[str]]:
    """The first `limit` validation samples of `batches` (scored DataProto batches, `scores` one per row in order)
    as [input, output, score] text rows (veRL's log_val_generations): the prompt and the whole response (a
    dialogue's both sides, role markers included) without padding."""
    rows: list[list[str]] = []
    for batch in batches:
        for i in range(len(batch)):
            if len(rows) >= limit:
                return rows
            b = batch.batch
            prompt = b["prompts"][i][b["attention_mask"][i, :b["prompts"].size(1)].bool()]
            response = b["responses"][i][b["attention_mask"][i, b["prompts"].size(1):].bool()]
            rows.append([tokenizer.decode(prompt.tolist()), tokenizer.decode(response.tolist()),
                         f"{scores[len(rows)]:.4g}"])
    return rows
