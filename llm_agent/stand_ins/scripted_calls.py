"""Scripted calls played in process: a scripted agent against the scripted persona, both sides recorded.

A call alternates an agent (any callable from the agent-side chat messages to its raw output; by default
:class:`~llm_agent.stand_ins.scripted_policy.ScriptedAgent` of some quality) with the scenario's scripted persona
(:class:`~llm_agent.user_sim.server.scripted.ScriptedPersonaBackend`, seeded per call and turn). The record keeps the
dialogue turns (what the agent's warm start learns from) and every simulator request with the persona's raw
answer, exactly the messages a simulator client sends (what a simulator's fine-tuning and the simulator report
card's probes are made of). A call ends when the user completes or hangs up, the agent ends it (status 1 or -1),
the agent's output has no usable reply tag (that turn is kept, unheard), or after `max_turns` agent turns.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from llm_agent.scenario import Scenario, Turn, UserProfile, sample_behaviors
from llm_agent.user_sim.server.backend import SamplingParams
from llm_agent.user_sim.server.scripted import ScriptedPersonaBackend

__all__ = ["AgentFactory", "AgentFn", "ScriptedCall", "SimulatorExchange", "play_scripted_call",
           "scripted_calls", "scripted_policy_agents"]

AgentFn = Callable[[list[dict[str, str]]], str]
AgentFactory = Callable[[str, int], AgentFn]


@dataclass(frozen=True)
class SimulatorExchange:
    """One simulator request of a call (the chat messages a client sends) and the persona's raw answer."""

    messages: list[dict[str, str]]
    reply: str


@dataclass
class ScriptedCall:
    """One played call: the user's profile, the agent's quality, the turns in order, the simulator exchanges
    (one per heard agent turn) and how the call ended (`completed`, `hung_up`, `agent_ended`, `format_error`
    or `timeout`)."""

    profile: UserProfile
    quality: str
    dialogue: list[Turn] = field(default_factory=list)
    exchanges: list[SimulatorExchange] = field(default_factory=list)
    outcome: str = "timeout"


def scripted_policy_agents(scenario: Scenario) -> AgentFactory:
    """Agent factory of `ScriptedAgent` (qualities: `scripted_policy.QUALITIES`): (quality, seed) -> agent."""
    from llm_agent.stand_ins.scripted_policy import ScriptedAgent

    def factory(quality: str, seed: int) -> AgentFn:
        agent = ScriptedAgent(scenario, quality=quality, seed=seed)
        return lambda messages: agent.respond([(m["role"], m["content"]) for m in messages[1:]])

    return factory


def play_scripted_call(scenario: Scenario, profile: UserProfile, agent: AgentFn, backend: ScriptedPersonaBackend,
                       max_turns: int, reply_seed: Callable[[int], int], quality: str = "") -> ScriptedCall:
    """Play one call (see the module docstring); the persona's answer to agent turn t uses seed `reply_seed(t)`."""
    call = ScriptedCall(profile, quality)
    statuses = scenario.statuses
    for turn in range(max_turns):
        agent_turn = scenario.parse_agent_output(agent(scenario.render_agent_messages(call.dialogue)))
        call.dialogue.append(agent_turn)
        if agent_turn.parse_error or agent_turn.status not in (None, statuses.ongoing):
            call.outcome = "format_error" if agent_turn.parse_error else "agent_ended"
            return call
        messages = scenario.render_user_messages(profile, call.dialogue)
        reply = backend.complete(messages, SamplingParams(seed=reply_seed(turn))).choices[0].text
        call.exchanges.append(SimulatorExchange(messages, reply))
        user_turn = scenario.parse_user_output(reply)
        call.dialogue.append(user_turn)
        if user_turn.status not in (None, statuses.ongoing):
            call.outcome = "completed" if user_turn.status == statuses.completed else "hung_up"
            return call
    return call


def check_quality_mix(quality_mix: Mapping[str, float]) -> tuple[list[str], list[float]]:
    """(names, weights) of a quality mix; ValueError unless the weights are non-negative with a positive sum."""
    names = list(quality_mix)
    weights = [quality_mix[q] for q in names]
    if not names or any(not isinstance(w, (int, float)) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"quality_mix must map quality names to non-negative weights with a positive sum, "
                         f"got {dict(quality_mix)!r}")
    return names, weights


def scripted_calls(scenario: Scenario, n: int, quality_mix: Mapping[str, float], seed: int,
                   agent_factory: AgentFactory | None = None, max_turns: int = 10) -> Iterator[ScriptedCall]:
    """Play `n` calls. Call k draws, from one `random.Random(seed)`, an agent quality from `quality_mix`
    (name -> weight), a profile (uniform initial state, 1-3 library behaviours) and the agent's seed; the
    persona (seeded with `seed`) answers agent turn t with seed `seed * 1_000_003 + k * 101 + t`. The default
    agent factory is `scripted_policy_agents`."""
    names, weights = check_quality_mix(quality_mix)
    if n < 1 or max_turns < 1:
        raise ValueError(f"need n >= 1 and max_turns >= 1, got n={n}, max_turns={max_turns}")
    factory = agent_factory or scripted_policy_agents(scenario)
    backend = ScriptedPersonaBackend(scenario, seed=seed)
    rng = random.Random(seed)
    for k in range(n):
        quality = rng.choices(names, weights)[0]
        profile = scenario.profile(rng.choice(scenario.state_space()), sample_behaviors(scenario.behaviors, rng))
        agent = factory(quality, rng.randrange(2**31))
        yield play_scripted_call(scenario, profile, agent, backend, max_turns,
                                 lambda turn, k=k: seed * 1_000_003 + k * 101 + turn, quality)
