"""How the scripted persona's and a simulator's answers agree with a person's turns in human calls.

A human call's record (`python -m for_evaluation.chat`, `judge: human`) keeps in `previews`, one entry per person
turn (the turns whose `user_source` is "human", or "simulator" in records written before it existed),
what the scripted persona and a configured simulator answered to the same request (`PREVIEW_SOURCES`): {reply,
state, status, format_valid}, {"error"} when the simulator failed, or null when none was asked.

Per source, over the person turns it answered (an error fails every check):

- `format_valid_rate`: the answer was in the exact user tag protocol (turns whose validity was not recorded are
  left out);
- `state_agreement`, `direction_agreement`: the same new state / the same direction of change (down, none, up
  from the person's previous state: the profile's initial state before their first turn) on every dimension;
  `state_agreement/<dim>`, `direction_agreement/<dim>`: on that dimension;
- `status_agreement`: the same status (continue, agreed, hung up).

Intervals: percentile bootstrap over calls (`llm_agent.evaluation.stats.bootstrap_intervals`), as in the card.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from llm_agent.evaluation.stats import DEFAULT_CONFIDENCE, DEFAULT_RESAMPLES, Interval, bootstrap_intervals
from llm_agent.rollout.dialogue_record import HUMAN_USER_SOURCE, DialogueRecord
from llm_agent.scenario import Scenario

__all__ = ["HUMAN_JUDGE", "PREVIEW_SOURCES", "PersonTurnPreview", "agreement_keys",
           "agreement_metrics", "human_records", "human_section", "person_turns"]

HUMAN_JUDGE = "human"  # a human call's `judge`
PREVIEW_SOURCES = ("scripted", "simulator")  # the answers to the same request kept beside the person's
_PERSON_SOURCES = (HUMAN_USER_SOURCE, "simulator")  # "simulator": records written before HUMAN_SOURCE


@dataclass(frozen=True)
class PersonTurnPreview:
    """One person turn: the state before it, the state and status the person reported, and the previews."""

    previous: dict[str, int]
    state: dict[str, int | None]
    status: int | None
    previews: dict[str, Any]


def human_records(records: Sequence[DialogueRecord]) -> list[DialogueRecord]:
    """The records of calls a person played (`judge: human`)."""
    return [r for r in records if r.extra.get("judge") == HUMAN_JUDGE]


def person_turns(record: DialogueRecord, scenario: Scenario, where: str = "record") -> list[PersonTurnPreview]:
    """The person turns of a human call's record with their previews; ValueError naming `where` when `previews`
    is not one object per person turn."""
    previews = record.extra.get("previews")
    turns = [t for t in record.turns if t.user_source in _PERSON_SOURCES]
    if not isinstance(previews, list) or len(previews) != len(turns):
        got = len(previews) if isinstance(previews, list) else type(previews).__name__
        raise ValueError(f"{where}: 'previews' must hold one entry per person turn ({len(turns)}), got {got}")
    state = record.initial_state(scenario.dims, where)
    out = []
    for k, (turn, preview) in enumerate(zip(turns, previews)):
        if not isinstance(preview, Mapping):
            raise ValueError(f"{where}: previews[{k}] must be an object")
        reported = dict(turn.user_state or {})
        out.append(PersonTurnPreview(dict(state), reported, turn.user_status, dict(preview)))
        state.update({d: v for d, v in reported.items() if d in state and isinstance(v, int)})
    return out


def agreement_keys(dims: Sequence[str]) -> tuple[str, ...]:
    """The metric names of one source, in display order."""
    return ("format_valid_rate", "state_agreement", "direction_agreement", "status_agreement",
            *(f"state_agreement/{d}" for d in dims), *(f"direction_agreement/{d}" for d in dims))


def _sign(value: int) -> int:
    return (value > 0) - (value < 0)


def _checks(turn: PersonTurnPreview, answer: Mapping[str, Any], dims: Sequence[str]) -> dict[str, bool | None]:
    """The per-turn checks of one answer (None: not known)."""
    if "error" in answer:
        return {"format_valid_rate": False, "status_agreement": False,
                **{f"state_agreement/{d}": False for d in dims}, **{f"direction_agreement/{d}": False for d in dims}}
    state = answer.get("state") if isinstance(answer.get("state"), Mapping) else {}
    valid = answer.get("format_valid")
    out: dict[str, bool | None] = {"format_valid_rate": valid if isinstance(valid, bool) else None,
                                   "status_agreement": answer.get("status") == turn.status}
    for d in dims:
        theirs, mine, before = state.get(d), turn.state.get(d), turn.previous[d]
        known = isinstance(theirs, int) and isinstance(mine, int)
        out[f"state_agreement/{d}"] = known and theirs == mine
        out[f"direction_agreement/{d}"] = known and _sign(theirs - before) == _sign(mine - before)
    return out


def agreement_metrics(calls: Sequence[Sequence[PersonTurnPreview]], source: str,
                      dims: Sequence[str]) -> dict[str, float | None]:
    """Every metric of the module docstring for `source` over `calls` (None: no turn to measure it on)."""
    rows = [_checks(t, t.previews[source], dims) for call in calls for t in call
            if isinstance(t.previews.get(source), Mapping)]
    for row in rows:
        row["state_agreement"] = all(row[f"state_agreement/{d}"] for d in dims)
        row["direction_agreement"] = all(row[f"direction_agreement/{d}"] for d in dims)
    out = {}
    for key in agreement_keys(dims):
        known = [row[key] for row in rows if row[key] is not None]
        out[key] = float(np.mean(known)) if known else None
    return out


def _status_pairs(calls: Sequence[Sequence[PersonTurnPreview]], source: str, scenario: Scenario) -> dict[str, int]:
    """Turns per (the person's status, the answer's status), as "person->answer" (names: continue, agreed,
    hung up; "error" for a failed answer)."""
    s = scenario.statuses
    names = {s.ongoing: "continue", s.completed: "agreed", s.ended: "hung up"}
    pairs: Counter[str] = Counter()
    for call in calls:
        for t in call:
            answer = t.previews.get(source)
            if isinstance(answer, Mapping):
                theirs = "error" if "error" in answer else names.get(answer.get("status"), "none")
                pairs[f"{names.get(t.status, 'none')}->{theirs}"] += 1
    return dict(sorted(pairs.items()))


def _json(value: Interval | float | None) -> Any:
    return value.to_dict() if isinstance(value, Interval) else value


def human_section(records: Sequence[DialogueRecord], scenario: Scenario, n_resamples: int = DEFAULT_RESAMPLES,
                  confidence: float = DEFAULT_CONFIDENCE, seed: int = 0) -> dict[str, Any] | None:
    """The card's `human` section for the human calls among `records` (None when there are none): counts and,
    per preview source that answered some turn, its metrics ({value, low, high, resamples} when `n_resamples` >
    0) and status pairs."""
    humans = human_records(records)
    if not humans:
        return None
    calls = [person_turns(r, scenario, f"human call {r.dialogue_id[:100]!r}") for r in humans]
    dims = scenario.dims
    sources = {}
    for source in PREVIEW_SOURCES:
        answered = [t for call in calls for t in call if isinstance(t.previews.get(source), Mapping)]
        if not answered:
            continue
        def statistic(rows: Sequence[Sequence[PersonTurnPreview]], source: str = source) -> dict[str, float | None]:
            return agreement_metrics(rows, source, dims)
        metrics = (bootstrap_intervals(calls, statistic, n_resamples, confidence, seed) if n_resamples > 0
                   else statistic(calls))
        sources[source] = {"n_turns": len(answered), "n_errors": sum("error" in t.previews[source] for t in answered),
                           "metrics": {k: _json(metrics.get(k)) for k in agreement_keys(dims)},
                           "status_pairs": _status_pairs(calls, source, scenario)}
    return {"n_calls": len(calls), "n_person_turns": sum(len(c) for c in calls), "sources": sources}
