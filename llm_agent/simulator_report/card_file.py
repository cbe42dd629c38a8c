"""A simulator report card read back from its JSON file (`--card`, `--simulator-card`): outside input, checked.

The file is decoded within size and nesting limits (`verl.utils.untrusted`) and must be a card: an object with a
string `name`, a `metrics` object whose every value is null, a finite number or {value, low, high} of those, and,
when present, `source`, `examples`, `human` and `by_agent` objects (each example an object, each `by_agent` row an
object of such metric values). Anything else is one ValueError naming the file and the first wrong field, so the
commands that show cards print one line instead of a traceback.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from verl.utils.untrusted import UntrustedInputError, load_json

__all__ = ["MAX_CARD_BYTES", "read_card"]

MAX_CARD_BYTES = 64 << 20  # a card is a few KB; its examples are cut to 400 characters each


def _number(value: Any) -> bool:
    return value is None or (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value))


def _metric(value: Any) -> bool:
    parts = [value.get(k) for k in ("value", "low", "high")] if isinstance(value, dict) else [value]
    return all(_number(v) for v in parts)


def _check(card: Any) -> str | None:
    """The first problem of `card` as a card (None: it is one)."""
    if not isinstance(card, dict):
        return f"a card is a JSON object, got {type(card).__name__}"
    if not isinstance(card.get("name"), str):
        return "'name' must be a string"
    metrics = card.get("metrics")
    if not isinstance(metrics, dict):
        return "'metrics' must be an object"
    for key, value in metrics.items():
        if not _metric(value):
            return f"metric {key[:100]!r} must be null, a finite number or {{value, low, high}} of those"
    for key in ("source", "examples", "human", "by_agent"):
        if key in card and not isinstance(card[key], dict):
            return f"{key!r} must be an object"
    for agent, row in (card.get("by_agent") or {}).items():
        if not isinstance(row, dict) or not all(_metric(v) for v in row.values()):
            return f"by_agent {agent[:100]!r} must be an object of null, finite numbers or {{value, low, high}}"
    for kind, rows in (card.get("examples") or {}).items():
        if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
            return f"examples {kind[:100]!r} must be a list of objects"
    return None


def read_card(path: str | os.PathLike) -> dict[str, Any]:
    """The card in the JSON file `path`; ValueError naming the file and the problem (see the module docstring)."""
    try:
        card = load_json(Path(path).read_bytes(), what=str(path), max_bytes=MAX_CARD_BYTES)
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror or exc}") from None
    except UntrustedInputError as exc:
        raise ValueError(str(exc)) from None
    problem = _check(card)
    if problem:
        raise ValueError(f"{path} is not a simulator report card: {problem}")
    return card
