"""Hand-made dialogue records for the evaluation statistics and table tests (only the keys the metrics read)."""
from __future__ import annotations

from typing import Any

from llm_agent.rollout.dialogue_record import DialogueRecord


def record(outcome: str, num_turns: int = 3, index: int = 0, profile: tuple[int, int, int] = (2, 2, 2),
           step: int = 0, split: str = "eval") -> dict[str, Any]:
    """A dialogue record `test<index>#0` with `num_turns` empty turns and the given outcome and initial state."""
    return {"step": step, "split": split, "uid": f"test{index}", "dialogue_id": f"test{index}#0",
            "profile": dict(zip(("cooperation", "emotion", "trust"), profile), behaviors=[]),
            "outcome": outcome, "num_turns": num_turns, "turns": [{} for _ in range(num_turns)],
            "cache_hits": 0, "format_errors": 0}


def typed_record(*args: Any, **kwargs: Any) -> DialogueRecord:
    """`record(...)` read as the typed record the rollout loop makes (what the statistics take)."""
    return DialogueRecord.from_dict(record(*args, **kwargs))


def linear_percentile(values: list[float], q: float) -> float:
    """The q-quantile with linear interpolation between order statistics (h = (n - 1) q), written out by hand."""
    ordered = sorted(values)
    h = (len(ordered) - 1) * q
    lo = int(h)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (h - lo) * (ordered[hi] - ordered[lo])
