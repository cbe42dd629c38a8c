"""The rollout loop's output helpers: `non_tensor_batch` columns, rollout-log lines and JSONL appends.

A rollout-log line is one JSON object per dialogue: its `DialogueRecord.to_dict()` (`step`, `split`, then the
record's fields, docs/rollout_loop.md), so logs of earlier runs read back with `DialogueRecord.from_dict`.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from llm_agent.rollout.dialogue_record import DialogueRecord

logger = logging.getLogger(__name__)

__all__ = ["append_jsonl", "log_lines", "object_column", "prefixed"]


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


def log_lines(records: Iterable[DialogueRecord], step: int, split: str) -> list[str]:
    """One JSON line per dialogue record, with its `step` and `split`."""
    lines = []
    for record in records:
        line = record.to_dict()
        line.update(step=step, split=split)
        lines.append(json.dumps(line, default=_jsonable, ensure_ascii=False))
    return lines


def append_jsonl(path: str | os.PathLike, lines: Sequence[str]) -> None:
    """Append `lines` to the JSONL file at `path` (parent directories created) in one write."""
    if not lines:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "a", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))
    logger.debug("appended %d lines to %s", len(lines), target)
