"""What the user-response cache holds: a cached reply, its stored entry, the JSONL line checks, and the coarse
user-state level that buckets replies (see `response_cache.py`)."""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from llm_agent.cache.config import is_int
from llm_agent.scenario import StateSchema

__all__ = ["CachedReply", "Entry", "LINE_KEYS", "check_state", "parse_line", "state_level_fn"]

LINE_KEYS = frozenset({"scenario", "stage", "reply", "state", "status", "ts"})


@dataclass(frozen=True)
class CachedReply:
    """A stored simulator reply: the agent stage it answered, its text, its state tags and its status (0)."""

    stage: int
    reply: str
    state: dict[str, int | None]
    status: int = 0


@dataclass
class Entry:
    """One cached reply with its insertion order (seq, for oldest-first eviction) and wall-clock time."""

    seq: int
    ts: float
    reply: CachedReply

    def key(self) -> tuple:
        """Deduplication key: the text and the state tags (the stage is the bucket)."""
        return self.reply.reply, tuple(sorted(self.reply.state.items()))


def check_state(state: Any) -> str | None:
    """None when `state` maps str -> int|None, else the reason why not."""
    if not isinstance(state, Mapping):
        return f"state must be an object, got {type(state).__name__}"
    for dim, value in state.items():
        if not isinstance(dim, str):
            return f"state keys must be strings, got {dim!r}"
        if not (value is None or is_int(value)):
            return f"state[{dim!r}] must be an int or null, got {value!r}"
    return None


def state_level_fn(levels: int, schema: StateSchema | None) -> Callable[[Any], int]:
    """A function mapping a user state to one of `levels` coarse levels: how well off the user is over the
    dimensions present (`StateSchema.goodness`: the mean of (value - min) / (max - min), turned round for a
    dimension where lower is better), cut into `levels` equal bins (a state with no dimension: the middle level).
    With levels <= 1 or no schema every state is level 0 (buckets by stage only)."""
    if levels <= 1 or schema is None:
        return lambda state: 0

    def level(state: Any) -> int:
        mean = schema.goodness(state) if isinstance(state, Mapping) else None
        if mean is None:
            return levels // 2
        return min(levels - 1, int(min(1.0, max(0.0, mean)) * levels))

    return level


def parse_line(obj: Any) -> str | None:
    """None when `obj` is a well-formed cache line, else the reason why not."""
    if not isinstance(obj, dict):
        return f"not an object but {type(obj).__name__}"
    missing, extra = LINE_KEYS - set(obj), set(obj) - LINE_KEYS
    if missing or extra:
        return f"missing keys {sorted(missing)}, unknown keys {sorted(extra)}"
    if not isinstance(obj["scenario"], str):
        return "scenario must be a string"
    if not is_int(obj["stage"]) or obj["stage"] < 0:
        return f"stage must be an int >= 0, got {obj['stage']!r}"
    if not isinstance(obj["reply"], str) or not obj["reply"].strip():
        return "reply must be a non-empty string"
    if obj["status"] != 0 or not is_int(obj["status"]):
        return f"status must be 0 (only non-terminal replies are cached), got {obj['status']!r}"
    if isinstance(obj["ts"], bool) or not isinstance(obj["ts"], (int, float)) or not math.isfinite(obj["ts"]):
        return f"ts must be a finite number, got {obj['ts']!r}"
    return check_state(obj["state"])
