"""The report card's fixed probes and how a simulator is run on them.

`build_probe_set(scenario)` plays `n_dialogues` scripted calls (`llm_agent.stand_ins.scripted_calls`: profiles,
agent qualities and the agents' words drawn from `seed`; good, evasive, wrong-answer and pushy agents by default)
against the scripted persona and keeps every simulator request of them, each dialogue labelled with its agent's
quality: a fixed set of profiles and agent turns, each request holding the persona and the dialogue so far with
the scripted persona's replies (the same histories for every simulator graded, so cards are comparable turn for
turn). The default seed is not the one the simulator's fine-tuning plays its calls with.

`run_probes(client, probe_set, sampling)` sends every request to a simulator through any `SimulatorClient`
(`UserSimClient` over HTTP, or the in-process scripted simulator) and re-requests a malformed
reply with a new seed as the rollout loop does, up to `reply_retries` times; a turn no instance answered is not
re-requested (the loop ends such a dialogue as an error).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from llm_agent.envs import stable_seed
from llm_agent.scenario import Scenario
from llm_agent.simulator_report.turns import SimDialogue, SimTurn
from llm_agent.stand_ins.scripted_calls import scripted_calls
from llm_agent.user_sim.client import SimulatorClient, TurnFailure, TurnReply, TurnRequest

__all__ = ["DEFAULT_QUALITY_MIX", "PROBE_SEED", "ProbeSampling", "ProbeSet", "build_probe_set", "run_probes"]

PROBE_SEED = 104_729
DEFAULT_QUALITY_MIX = {"good": 0.4, "evasive": 0.2, "wrong_answer": 0.2, "bad": 0.2}


@dataclass(frozen=True)
class ProbeSet:
    """The fixed requests: per probe dialogue its id, profile and simulator requests, plus how they were made."""

    dialogues: tuple[SimDialogue, ...]
    seed: int
    quality_mix: dict[str, float] = field(default_factory=dict)
    max_turns: int = 8

    @property
    def n_requests(self) -> int:
        """Simulator requests in the set."""
        return sum(len(d.turns) for d in self.dialogues)

    def describe(self) -> dict[str, Any]:
        """How the set was made (for the card's `source`)."""
        return {"dialogues": len(self.dialogues), "requests": self.n_requests, "seed": self.seed,
                "quality_mix": dict(self.quality_mix), "max_turns": self.max_turns}


def build_probe_set(scenario: Scenario, n_dialogues: int = 48, seed: int = PROBE_SEED,
                    quality_mix: Mapping[str, float] | None = None, max_turns: int = 8) -> ProbeSet:
    """The probe set of `n_dialogues` scripted calls (see the module docstring)."""
    mix = dict(quality_mix or DEFAULT_QUALITY_MIX)
    dialogues = []
    for k, call in enumerate(scripted_calls(scenario, n_dialogues, mix, seed, max_turns=max_turns)):
        turns = [SimTurn(exchange.messages) for exchange in call.exchanges]
        if turns:
            dialogues.append(SimDialogue(f"probe-{k:04d}", call.profile, turns, agent=call.quality))
    return ProbeSet(tuple(dialogues), seed, mix, max_turns)


@dataclass(frozen=True)
class ProbeSampling:
    """The decoding parameters of the probe requests (the rollout loop's `user_sim` defaults) and the number of
    re-requests of a malformed reply; `seed` varies every request's seed."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    reply_retries: int = 2
    seed: int = 0


@dataclass
class _Pending:
    dialogue: int
    turn: int
    replies: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    failure: str | None = None


def run_probes(client: SimulatorClient, probe_set: ProbeSet, scenario: Scenario, sampling: ProbeSampling = ProbeSampling(),
               concurrency: int = 32) -> list[SimDialogue]:
    """The probe set's dialogues with every request answered by `client` (see the module docstring); at most
    `concurrency` requests are in flight at once."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    slots = [_Pending(i, j) for i, d in enumerate(probe_set.dialogues) for j in range(len(d.turns))]
    pending = list(slots)
    with tqdm(total=len(slots), desc="simulator probes", leave=False) as bar:
        for attempt in range(sampling.reply_retries + 1):
            retry = []
            for start in range(0, len(pending), concurrency):
                chunk = pending[start:start + concurrency]
                requests = [_request(probe_set, p, attempt, sampling) for p in chunk]
                for slot, result in zip(chunk, client.complete(requests)):
                    if isinstance(result, TurnFailure):
                        slot.failure = result.reason
                    elif isinstance(result, TurnReply):
                        slot.replies.append(result.text)
                        slot.latencies.append(result.latency_s)
                        if scenario.parse_user_output(result.text).parse_error:
                            retry.append(slot)
                            continue
                    else:
                        raise TypeError(f"the simulator client answered a {type(result).__name__}")
                    bar.update(1)
            pending = retry
            if not pending:
                break
        bar.update(len(pending))
    out = [SimDialogue(d.dialogue_id, d.profile, agent=d.agent) for d in probe_set.dialogues]
    for slot in slots:
        messages = probe_set.dialogues[slot.dialogue].turns[slot.turn].messages
        out[slot.dialogue].turns.append(SimTurn(messages, tuple(slot.replies), tuple(slot.latencies), slot.failure))
    return out


def _request(probe_set: ProbeSet, slot: _Pending, attempt: int, sampling: ProbeSampling) -> TurnRequest:
    dialogue = probe_set.dialogues[slot.dialogue]
    return TurnRequest(f"{dialogue.dialogue_id}/{slot.turn}", dialogue.turns[slot.turn].messages,
                       temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=sampling.max_tokens,
                       seed=stable_seed(sampling.seed, dialogue.dialogue_id, slot.turn, attempt))
