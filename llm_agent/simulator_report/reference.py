"""What the scenario's scripted persona does with a simulator request: the reference a simulator is graded by.

`ScriptedReference.react(messages)` replays the request through the scripted backend (the persona re-syncs its
state with the simulator's own earlier replies in the request, so the reference starts where the dialogue
stands) and returns the user's state before the turn, the persona's state and status after it, the events its
cue lists detected in the agent's words, the direction those events push each dimension (the sign of their summed
effects in the scenario's effect table) and the behaviour category whose doubt it voices, if any.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from llm_agent.scenario import Scenario
from llm_agent.user_sim.server.scripted import ScriptedPersonaBackend

__all__ = ["Reference", "ScriptedReference", "carried_state"]


def _sign(value: int) -> int:
    return (value > 0) - (value < 0)


def carried_state(scenario: Scenario, messages: Sequence[Mapping[str, str]]) -> dict[str, int]:
    """The user's state when the request's last agent turn is heard: the persona's initial state, then each
    dimension as the simulator's own earlier replies (`assistant` messages) last reported it (what the rollout
    loop carries as the dialogue's state)."""
    state = dict(scenario.recover_profile(messages[0]["content"]).state)
    for message in messages[1:]:
        if message["role"] == "assistant":
            reported = scenario.parse_user_output(message["content"]).state
            state.update({d: v for d, v in reported.items() if isinstance(v, int)})
    return state


@dataclass(frozen=True)
class Reference:
    """The scripted persona's reaction to one request (see the module docstring)."""

    previous: dict[str, int]
    state: dict[str, int]
    status: int
    events: tuple[str, ...]
    polarity: dict[str, int]
    doubt: str | None

    @property
    def delta(self) -> dict[str, int]:
        """The persona's change of each dimension in this turn."""
        return {d: self.state[d] - self.previous[d] for d in self.state}

    @property
    def direction(self) -> dict[str, int]:
        """The sign (-1, 0, 1) of each dimension's change."""
        return {d: _sign(v) for d, v in self.delta.items()}


class ScriptedReference:
    """Reactions of the scenario's scripted persona to simulator requests (deterministic; see module docstring)."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self._backend = ScriptedPersonaBackend(scenario)

    def react(self, messages: Sequence[Mapping[str, str]]) -> Reference:
        """The reference for the request `messages` (persona system message, ..., the agent's last turn).

        Raises `llm_agent.user_sim.server.backend.BackendInputError` when the messages are not such a request of this
        scenario."""
        messages = [dict(m) for m in messages]
        persona, outcome, _ = self._backend.replay(messages)
        effects = self.scenario.scripted.effects
        totals = {d: sum(effects.get(e, {}).get(d, 0) for e in outcome.events) for d in self.scenario.dims}
        line = outcome.line
        doubt = line[1] if isinstance(line, tuple) and line[0] == "doubt" else None
        return Reference(previous=carried_state(self.scenario, messages), state=dict(persona.state),
                         status=outcome.status, events=tuple(outcome.events),
                         polarity={d: _sign(v) for d, v in totals.items()}, doubt=doubt)
