"""The dialogue browser's data: dialogue records turned into one compact JSON document for the report page.

Each dialogue becomes an object with short keys (documented in `report_assets/report.js`); behaviours are
indices into one shared table so 10,000+ dialogues stay a few megabytes. `embed_json` makes the text safe to
put inside a `<script type="application/json">` element.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from llm_agent.evaluation.page_text import bounded
from llm_agent.metrics import OUTCOMES
from llm_agent.scenario import STATE_DIMS, Scenario

__all__ = ["browser_payload", "embed_json"]


def _state_list(state: Any) -> list[int | None] | None:
    """[cooperation, emotion, trust] of a turn's state dict (None entries kept), None for no state."""
    if not isinstance(state, Mapping):
        return None
    return [state.get(d) for d in STATE_DIMS]


def _turn(turn: Mapping[str, Any]) -> dict[str, Any]:
    return {"at": turn.get("agent_text"), "ar": turn.get("agent_reply"), "as": turn.get("agent_stage"),
            "ast": turn.get("agent_status"), "ae": _state_list(turn.get("agent_state")),
            "ok": turn.get("agent_format_ok", True), "ur": turn.get("user_reply"), "us": turn.get("user_status"),
            "ue": _state_list(turn.get("user_state")), "src": turn.get("user_source"), "err": turn.get("user_error"),
            "dx": _diagnosis(turn.get("diagnosis"))}


def _diagnosis(entries: Any) -> list[list[str]]:
    """[[label, note], ...] of a turn's failure labels (`llm_agent.diagnosis`); [] for none or a malformed entry."""
    if not isinstance(entries, Sequence) or isinstance(entries, str):
        return []
    return [[str(e.get("label", "")), str(e.get("note", ""))] for e in entries if isinstance(e, Mapping)]


def _labels(labels: Any) -> dict[str, int]:
    """A record's {failure label: turns carrying it}; {} for none or a malformed value."""
    if not isinstance(labels, Mapping):
        return {}
    return {str(k): int(v) for k, v in labels.items() if isinstance(v, int) and not isinstance(v, bool)}


def _number(value: Any) -> float | None:
    """A finite number as float, anything else (None, NaN, text) as None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def browser_payload(records: Sequence[Mapping[str, Any]], scenario: Scenario | None = None) -> dict[str, Any]:
    """{"dims", "outcomes", "stages", "behaviors", "dialogues"}: everything the page's JavaScript needs.

    `stages` maps stage id to name (empty without a scenario). Records must hold `outcome`, `profile` and `turns`.
    Every string is bounded (`page_text.bounded`: a huge logged field is cut with a marker).
    """
    behaviors: dict[tuple[str, str], int] = {}
    dialogues = []
    for i, record in enumerate(records):
        profile = record.get("profile") or {}
        beh_ids = []
        for b in profile.get("behaviors") or []:
            key = (str(b.get("category", "")), str(b.get("behavior", "")))
            beh_ids.append(behaviors.setdefault(key, len(behaviors)))
        components = record.get("reward_components")
        dialogues.append({
            "i": i, "id": record.get("dialogue_id") or f"#{i}", "step": record.get("step"),
            "split": record.get("split") or "all", "o": record.get("outcome"),
            "s": [profile.get(d) for d in STATE_DIMS], "b": beh_ids, "n": record.get("num_turns"),
            "r": _number(record.get("reward")),
            "rc": {k: _number(v) for k, v in components.items()} if isinstance(components, Mapping) else None,
            "ch": record.get("cache_hits"), "fe": record.get("format_errors"), "e": record.get("error"),
            "lb": _labels(record.get("labels")),
            "t": [_turn(t) for t in record.get("turns") or [] if isinstance(t, Mapping)],
        })
    return bounded({"dims": list(STATE_DIMS), "outcomes": list(OUTCOMES),
                    "stages": {str(s.id): s.name for s in scenario.stages} if scenario is not None else {},
                    "behaviors": [{"category": c, "behavior": b} for (c, b) in behaviors],
                    "dialogues": dialogues})


def embed_json(value: Any) -> str:
    """JSON text that cannot end a `<script>` element early or open an HTML comment inside it."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026") \
        .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
