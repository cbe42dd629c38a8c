"""Per-step metrics of the PPO trainer: data statistics, phase timings, throughput, and reduction helpers.

Names follow veRL: ``critic/score/mean`` (sequence scores), ``critic/rewards/mean`` (after KL shaping),
``critic/advantages/*``, ``critic/returns/*``, ``critic/values/*``, ``response_length/{mean,max,min,clip_ratio}``,
``prompt_length/*``, ``timing_s/<phase>``, ``timing_per_token_ms/<phase>``, ``perf/*``.
:func:`format_console_line` is the compact per-step console summary (the full set goes to the other tracking
backends). ``reduce_metrics`` (veRL's max/min/mean rule) lives in :mod:`verl.utils.metric`, the validation
metrics (``bootstrap_metric``, ``calc_maj_val``, ``process_validation_metrics``) in
:mod:`verl.trainer.ppo.validation_metrics`; both are re-exported here.
"""
from __future__ import annotations

import logging
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch

from verl.protocol import DataProto
from verl.trainer.ppo.validation_metrics import bootstrap_metric, calc_maj_val, process_validation_metrics
from verl.utils.metric import reduce_metrics

__all__ = [
    "bootstrap_metric", "calc_maj_val", "compute_data_metrics", "compute_throughout_metrics",
    "compute_timing_metrics", "format_console_line", "process_validation_metrics", "reduce_metrics",
    "setup_console_logger", "timer",
]  # fmt: skip

console_logger = logging.getLogger("verl.trainer.console")

NOT_AVAILABLE = "n/a"  # how the console line shows an undefined metric
# (metric, short label) of the console line, in order; absent metrics are skipped.
CONSOLE_METRICS = (
    ("critic/score/mean", "score"), ("critic/rewards/mean", "reward"), ("actor/pg_loss", "pg_loss"),
    ("critic/vf_loss", "vf_loss"), ("actor/ppo_kl", "ppo_kl"), ("actor/kl_loss", "kl_loss"),
    ("actor/reward_kl_penalty", "kl_rwd"), ("actor/entropy", "entropy"), ("actor/pg_clipfrac", "clipfrac"),
    ("actor/grad_norm", "grad_norm"), ("actor/lr", "lr"), ("response_length/mean", "resp_len"),
    ("perf/tokens_per_s", "tok/s"), ("timing_s/step", "step_s"),
)


@contextmanager
def timer(name: str, timing: dict[str, float]) -> Iterator[None]:
    """Add the wall time of the ``with`` body (seconds) to ``timing[name]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timing[name] = timing.get(name, 0.0) + time.perf_counter() - start


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    if values.numel() == 0:
        return {}
    return {f"{prefix}/mean": float(values.mean()), f"{prefix}/max": float(values.max()),
            f"{prefix}/min": float(values.min())}


def compute_data_metrics(batch: DataProto, use_critic: bool) -> dict[str, float]:
    """Scores, rewards, advantages (and the share of loss tokens whose advantage is not 0), returns, values and
    prompt/response lengths of a trained batch."""
    response_mask = batch.batch["response_mask"].bool()
    responses = batch.batch["responses"]
    max_response_length = responses.shape[-1]
    prompt_mask = batch.batch["attention_mask"][:, :-max_response_length].bool()
    response_length = response_mask.sum(-1).float()
    prompt_length = prompt_mask.sum(-1).float()
    metrics = {}
    metrics.update(_stats("critic/score", batch.batch["token_level_scores"].sum(-1)))
    metrics.update(_stats("critic/rewards", batch.batch["token_level_rewards"].sum(-1)))
    advantages = torch.masked_select(batch.batch["advantages"], response_mask)
    metrics.update(_stats("critic/advantages", advantages))
    if advantages.numel():  # 0: no loss token carries a policy-gradient signal this step
        metrics["critic/advantages/nonzero_frac"] = float((advantages != 0).float().mean())
    metrics.update(_stats("critic/returns", torch.masked_select(batch.batch["returns"], response_mask)))
    if use_critic and "values" in batch.batch.keys():
        values = torch.masked_select(batch.batch["values"], response_mask).float()
        returns = torch.masked_select(batch.batch["returns"], response_mask).float()
        metrics.update(_stats("critic/values", values))
        metrics["critic/vf_explained_var"] = float(1.0 - (returns - values).var() / (returns.var() + 1e-5))
    metrics.update(_stats("response_length", response_length))
    metrics["response_length/clip_ratio"] = float((response_length >= max_response_length).float().mean())
    metrics.update(_stats("prompt_length", prompt_length))
    return metrics


def _compute_response_info(batch: DataProto) -> dict[str, torch.Tensor]:
    """Per row: ``prompt_length`` and ``response_length`` (float token counts) and the ``response_mask`` (bs, R)
    (``batch['response_mask']`` when present: loss-carrying tokens; else the attention mask's response part)."""
    response_width = batch.batch["responses"].shape[-1]
    attention_mask = batch.batch["attention_mask"]
    if "response_mask" in batch.batch.keys():
        response_mask = batch.batch["response_mask"]
    else:
        response_mask = attention_mask[:, -response_width:]
    return {
        "prompt_length": attention_mask[:, :-response_width].sum(-1).float(),
        "response_length": response_mask.sum(-1).float(),
        "response_mask": response_mask,
    }


def compute_timing_metrics(batch: DataProto, timing_raw: Mapping[str, float]) -> dict[str, float]:
    """``timing_s/<phase>`` plus ``timing_per_token_ms/<phase>`` for every phase but ``step``: per response token
    for ``gen``, per prompt+response token otherwise; 0.0 when the batch has no such tokens."""
    info = _compute_response_info(batch)
    response_tokens = float(info["response_length"].sum())
    all_tokens = response_tokens + float(info["prompt_length"].sum())
    metrics = {f"timing_s/{name}": value for name, value in timing_raw.items()}
    for name, value in timing_raw.items():
        tokens = response_tokens if name == "gen" else all_tokens
        if name != "step":
            metrics[f"timing_per_token_ms/{name}"] = 1000.0 * value / tokens if tokens > 0 else 0.0
    return metrics


def compute_throughout_metrics(batch: DataProto, timing_raw: Mapping[str, float], n_gpus: int) -> dict[str, float]:
    """veRL's throughput metrics (its spelling): tokens of the step (``meta_info['global_token_num']`` summed,
    else the attention-mask total), ``timing_raw['step']``, tokens per second overall and per worker (n_gpus)."""
    if "global_token_num" in batch.meta_info:
        total_tokens = float(np.sum(batch.meta_info["global_token_num"]))
    else:
        total_tokens = float(batch.batch["attention_mask"].sum())
    step_time = float(timing_raw["step"])
    return {
        "perf/total_num_tokens": total_tokens,
        "perf/time_per_step": step_time,
        "perf/tokens_per_s": total_tokens / step_time if step_time > 0 else 0.0,
        "perf/throughput": total_tokens / (step_time * n_gpus) if step_time > 0 else 0.0,
    }


def _short(value: float) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _namespace_logged(key: str, metrics: Mapping[str, Any]) -> bool:
    """True when `metrics` holds another key under `key`'s namespace (its path up to the last "/")."""
    namespace = key.rsplit("/", 1)[0] + "/"
    return any(k.startswith(namespace) for k in metrics)


def format_console_line(step: int, total_steps: int, metrics: Mapping[str, Any],
                        first: Sequence[tuple[str, str]] = ()) -> str:
    """One compact line: ``step 3/20 | <first> | score 0.41 | ... | val mean reward (<source>) 0.5`` with the
    metrics present (the last: ``val/test_score/<source>``, the mean reward of the validation samples).

    `first` are (metric, label) pairs shown right after the step, e.g. a rollout-loop plug-in's own
    `console_metrics` (what people watch in that kind of run); a label ending in "%" shows the value as a
    percentage, and a pair whose metric is a tuple of keys shows them together ("a/b/c" style). A `first` metric
    that is missing while its namespace was logged this step is undefined there (a plug-in leaves out a metric
    with an empty denominator, e.g. a completion rate over no dialogue) and shows as ``n/a``."""
    parts = [f"step {step}/{total_steps}"]
    for index, (key, label) in enumerate([*first, *CONSOLE_METRICS]):
        keys = key if isinstance(key, tuple) else (key,)
        values = [metrics.get(k) for k in keys]
        if any(v is None for v in values):
            undefined_here = index < len(first) and any(_namespace_logged(k, metrics) for k in keys)
            if not undefined_here:
                continue
        if label.endswith("%"):
            shown = "/".join(NOT_AVAILABLE if v is None else f"{100 * v:.0f}" for v in values)
            parts.append(f"{label[:-1]} {shown}%" if any(v is not None for v in values) else f"{label[:-1]} {shown}")
        else:
            parts.append(f"{label} {'/'.join(NOT_AVAILABLE if v is None else _short(v) for v in values)}")
    prefix = "val/test_score/"  # the mean validation reward per data source
    parts += [f"val mean reward ({key[len(prefix):]}) {_short(value)}" for key, value in metrics.items()
              if key.startswith(prefix)]
    return " | ".join(parts)


def setup_console_logger() -> logging.Logger:
    """The console-line logger at INFO, with a stdout handler when logging is otherwise unconfigured."""
    if console_logger.getEffectiveLevel() > logging.INFO:
        console_logger.setLevel(logging.INFO)
    if not console_logger.hasHandlers():
        console_logger.addHandler(logging.StreamHandler(sys.stdout))
    return console_logger
