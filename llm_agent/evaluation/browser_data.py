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
from llm_agent.rollout.dialogue_record import DialogueRecord, TurnRecord
from llm_agent.scenario import Scenario

__all__ = ["browser_payload", "embed_json", "profile_dims"]


def profile_dims(records: Sequence[DialogueRecord]) -> list[str]:
    """The state dimensions of the records' profiles (every key but `behaviors`, in the first profile's order)."""
    for record in records:
        if record.profile:
            return [k for k in record.profile if k != "behaviors"]
    return []


def _state_list(state: Any, dims: Sequence[str]) -> list[int | None] | None:
    """The values of `dims` in a turn's state dict (None entries kept), None for no state."""
    if not isinstance(state, Mapping):
        return None
    return [state.get(d) for d in dims]


def _turn(turn: TurnRecord, dims: Sequence[str]) -> dict[str, Any]:
    return {"at": turn.agent_text, "ar": turn.agent_reply, "as": turn.agent_stage, "ast": turn.agent_status,
            "ae": _state_list(turn.agent_state, dims), "ok": turn.agent_format_ok, "ur": turn.user_reply,
            "us": turn.user_status, "ue": _state_list(turn.user_state, dims), "src": turn.user_source,
            "err": turn.user_error, "dx": _diagnosis(turn.diagnosis)}


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


def browser_payload(records: Sequence[DialogueRecord], scenario: Scenario | None = None) -> dict[str, Any]:
    """{"dims", "outcomes", "stages", "behaviors", "dialogues"}: everything the page's JavaScript needs.

    `dims` are the scenario's state dimensions (without a scenario, the profiles'); `stages` maps stage id to name
    (empty without a scenario). Every string is bounded (`page_text.bounded`: a huge logged field is cut with a
    marker).
    """
    dims = list(scenario.dims) if scenario is not None else profile_dims(records)
    behaviors: dict[tuple[str, str], int] = {}
    dialogues = []
    for i, record in enumerate(records):
        profile = record.profile
        beh_ids = []
        for b in profile.get("behaviors") or []:
            key = (str(b.get("category", "")), str(b.get("behavior", "")))
            beh_ids.append(behaviors.setdefault(key, len(behaviors)))
        components = record.reward_components
        dialogues.append({
            "i": i, "id": record.dialogue_id or f"#{i}", "step": record.step, "split": record.split or "all",
            "o": record.outcome, "s": [profile.get(d) for d in dims], "b": beh_ids, "n": record.num_turns,
            "r": _number(record.reward),
            "rc": {k: _number(v) for k, v in components.items()} if isinstance(components, Mapping) else None,
            "ch": record.cache_hits, "fe": record.format_errors, "e": record.error, "lb": _labels(record.labels),
            "t": [_turn(t, dims) for t in record.turns],
        })
    return bounded({"dims": dims, "outcomes": list(OUTCOMES),
                    "stages": {str(s.id): s.name for s in scenario.stages} if scenario is not None else {},
                    "behaviors": [{"category": c, "behavior": b} for (c, b) in behaviors],
                    "dialogues": dialogues})


def embed_json(value: Any) -> str:
    """JSON text that cannot end a `<script>` element early or open an HTML comment inside it."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026") \
        .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
