"""Per-turn signals of a dialogue record: what each agent turn did to the user and to the call.

For agent turn k of a record (the rollout loop's `turns` column, docs/rollout_loop.md), with `span_d = max_d -
min_d` of the scenario's state range of dimension d and the SOP position of a stage its index in the scenario's
`stages`:

- `state_before`: the user's state before the turn: the profile's initial state, then each dimension as the user
  side last reported it (a cached turn carries the dialogue's own state, so it changes nothing);
- `state_delta`: {d: reported_d - before_d} for the dimensions the user side reported after the turn (0 for a
  dimension it did not report), None when nothing was reported (a format error, an agent that ended the call, a
  cut turn, a failed simulator turn);
- `state_change`: mean over the three dimensions of `state_delta_d / span_d` (0 without a delta). Summed over a
  dialogue's turns it is the reward's `state_transition` component (the deltas telescope to last - initial);
- `stage_reached`: the furthest SOP stage the agent has reported in a well-formed turn up to and including this one
  (None before any; the stage tag of a turn that broke the protocol, which the user never heard, does not count);
  `new_stage`: this turn moved it further; `stage_progress`: how far, `(position_k - position_{k-1}) / (S - 1)`
  with S stages and position -1 before any counted as 0 (so the dialogue's sum is the furthest position / (S-1));
- `format_error`: the agent's output broke the tag protocol (no usable reply tag, or stage/status out of range);
- `outcome_share`: the turn's signed share of the user's movement over the call, `state_change_k / sum_j
  |state_change_j|` (0 when the user never moved): the turns that carried a completed call have positive shares,
  the turns that lost a failed one negative shares; the absolute shares sum to 1.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from llm_agent.metrics import range_spans
from llm_agent.scenario import STATE_DIMS, Scenario

__all__ = ["SIGNAL_KEYS", "turn_signals"]

SIGNAL_KEYS: tuple[str, ...] = ("state_before", "state_delta", "state_change", "stage_reached", "new_stage",
                                "stage_progress", "format_error", "outcome_share")


def _initial_state(record: Mapping[str, Any], where: str) -> dict[str, int]:
    profile = record.get("profile")
    if not isinstance(profile, Mapping) or any(isinstance(profile.get(d), bool) or not isinstance(profile.get(d), int)
                                               for d in STATE_DIMS):
        raise ValueError(f"{where}: 'profile' must hold integer {list(STATE_DIMS)}, got {profile!r}")
    return {d: int(profile[d]) for d in STATE_DIMS}


def turn_signals(record: Mapping[str, Any], scenario: Scenario, where: str = "dialogue") -> list[dict[str, Any]]:
    """One dict of the module docstring's signals per agent turn of `record` (JSON-ready, in turn order)."""
    spans = range_spans(scenario)
    order = {sid: i for i, sid in enumerate(scenario.stage_ids)}
    last_position = max(len(order) - 1, 1)
    state = _initial_state(record, where)
    turns: Sequence[Any] = record.get("turns") or []
    position = -1
    out: list[dict[str, Any]] = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, Mapping):
            raise ValueError(f"{where}: turn {k} is a {type(turn).__name__}, not a turn record")
        before = dict(state)
        reported = turn.get("user_state")
        delta = None
        if isinstance(reported, Mapping) and any(reported.get(d) is not None for d in STATE_DIMS):
            delta = {d: int(reported[d]) - before[d] if reported.get(d) is not None else 0 for d in STATE_DIMS}
            state.update({d: int(reported[d]) for d in STATE_DIMS if reported.get(d) is not None})
        change = math.fsum(delta[d] / spans[d] for d in STATE_DIMS) / len(STATE_DIMS) if delta else 0.0
        previous = position
        stage = turn.get("agent_stage")
        if stage in order and turn.get("agent_format_ok", True):
            position = max(position, order[stage])
        out.append({
            "state_before": before, "state_delta": delta, "state_change": change,
            "stage_reached": scenario.stage_ids[position] if position >= 0 else None,
            "new_stage": position > previous,
            "stage_progress": (max(position, 0) - max(previous, 0)) / last_position,
            "format_error": not turn.get("agent_format_ok", True),
        })
    moved = math.fsum(abs(s["state_change"]) for s in out)
    for s in out:
        s["outcome_share"] = s["state_change"] / moved if moved > 0 else 0.0
    return out
