"""Per-dialogue output of the rollout loop: `non_tensor_batch` columns, rollout-log lines and JSONL appends.

The column names are the per-dialogue record of docs/rollout_loop.md (`uid`, `dialogue_id`, `profile`,
`state_key`, `outcome`, `num_turns`, `turns`, `messages`, `cache_hits`, `format_errors`, `sim_retries`,
`error`, `labels`) plus what the dialogue cost (`COST_COLUMNS`: `agent_tokens` generated, `sim_requests` sent,
`wall_s`, its share of the rollout call's wall time); a rollout-log line is one JSON object per dialogue with those
fields plus `step`, `split`, `reward`, `reward_components` and `turn_rewards`.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["COST_COLUMNS", "LOG_KEYS", "RECORD_COLUMNS", "append_jsonl", "log_lines", "object_column", "prefixed"]

RECORD_COLUMNS: tuple[str, ...] = ("uid", "dialogue_id", "profile", "state_key", "outcome", "num_turns", "turns",
                                   "messages", "cache_hits", "format_errors", "sim_retries", "error", "labels")
COST_COLUMNS: tuple[str, ...] = ("agent_tokens", "sim_requests", "wall_s")  # read by llm_agent.metrics
LOG_KEYS: tuple[str, ...] = ("uid", "dialogue_id", "profile", "state_key", "outcome", "num_turns", "turns",
                             "messages", "reward", "reward_components", "turn_rewards", "cache_hits", "format_errors",
                             "sim_retries", "error", "labels", *COST_COLUMNS)


def object_column(values: Sequence[Any]) -> np.ndarray:
    """A 1-D object array holding `values` element-wise (never a 2-D array, even for lists of lists)."""
    column = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        column[i] = value
    return column


def prefixed(metrics: Mapping[str, float], prefix: str) -> dict[str, float]:
    """`metrics` with `prefix` ("dialogue/") put in front of every key that does not already start with it."""
    return {(k if k.startswith(prefix) else prefix + k): float(v) for k, v in metrics.items()}


def _jsonable(value: Any) -> Any:
    """json.dumps fallback for numpy scalars and arrays."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def log_lines(records: Iterable[Mapping[str, Any]], step: int, split: str) -> list[str]:
    """One JSON line per dialogue record: `step`, `split` and the `LOG_KEYS` (missing keys as null)."""
    return [json.dumps({"step": step, "split": split, **{k: record.get(k) for k in LOG_KEYS}},
                       default=_jsonable, ensure_ascii=False) for record in records]


def append_jsonl(path: str | os.PathLike, lines: Sequence[str]) -> None:
    """Append `lines` to the JSONL file at `path` (parent directories created) in one write."""
    if not lines:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "a", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))
    logger.debug("appended %d lines to %s", len(lines), target)
