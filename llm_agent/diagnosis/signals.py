"""Per-turn signals of a dialogue record: what each agent turn did to the user and to the call.

For agent turn k of a record (a `DialogueRecord`'s `turns`, docs/rollout_loop.md), with `span_d = max_d - min_d`
of the scenario's state range of dimension d, `sign_d` +1 where higher values are better for the user (-1 where
lower ones are) and the SOP position of a stage its index in the scenario's `stages`:

- `state_before`: the user's state before the turn: the profile's initial state, then each dimension as the user
  side last reported it (a cached turn carries the dialogue's own state, so it changes nothing);
- `state_delta`: {d: reported_d - before_d} for the dimensions the user side reported after the turn (0 for a
  dimension it did not report), None when nothing was reported (a format error, an agent that ended the call, a
  cut turn, a failed simulator turn);
- `state_change`: mean over the dimensions of `sign_d * state_delta_d / span_d` (0 without a delta; positive: the
  user is better off). Summed over a dialogue's turns it is the reward's `state_transition` component (the deltas
  telescope to last - initial);
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
from typing import Any

from llm_agent.rollout.dialogue_record import DialogueRecord, TurnSignals
from llm_agent.scenario import Scenario

__all__ = ["SIGNAL_KEYS", "turn_signals"]

SIGNAL_KEYS: tuple[str, ...] = ("state_before", "state_delta", "state_change", "stage_reached", "new_stage",
                                "stage_progress", "format_error", "outcome_share")


def turn_signals(record: DialogueRecord, scenario: Scenario, where: str = "dialogue") -> list[TurnSignals]:
    """The module docstring's signals of every agent turn of `record`, in turn order."""
    schema = scenario.state_schema
    dims, spans = schema.names, schema.spans
    signs = {d.name: d.sign for d in schema.dimensions}
    order = {sid: i for i, sid in enumerate(scenario.stage_ids)}
    last_position = max(len(order) - 1, 1)
    state = record.initial_state(dims, where)
    position = -1
    out: list[TurnSignals] = []
    for turn in record.turns:
        before = dict(state)
        reported: Any = turn.user_state
        delta = None
        if reported is not None and any(reported.get(d) is not None for d in dims):
            delta = {d: int(reported[d]) - before[d] if reported.get(d) is not None else 0 for d in dims}
            state.update({d: int(reported[d]) for d in dims if reported.get(d) is not None})
        change = math.fsum(signs[d] * delta[d] / spans[d] for d in dims) / len(dims) if delta else 0.0
        previous = position
        if turn.agent_stage in order and turn.agent_format_ok:
            position = max(position, order[turn.agent_stage])
        out.append(TurnSignals(
            state_before=before, state_delta=delta, state_change=change,
            stage_reached=scenario.stage_ids[position] if position >= 0 else None, new_stage=position > previous,
            stage_progress=(max(position, 0) - max(previous, 0)) / last_position,
            format_error=not turn.agent_format_ok))
    moved = math.fsum(abs(s.state_change) for s in out)
    for s in out:
        s.outcome_share = s.state_change / moved if moved > 0 else 0.0
    return out
