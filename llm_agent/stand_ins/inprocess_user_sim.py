"""In-process user simulator: a `SimulatorClient` without HTTP or threads.

`InProcessUserSim` answers each :class:`TurnRequest` with the scenario's :class:`ScriptedPersonaBackend` in the
calling thread, so the rollout loop's tests and benchmarks run without servers. Two test switches:
- `fail_ids`: every turn of these dialogue ids comes back as a :class:`TurnFailure` (injected fault);
- `never_end=True`: every turn gets a non-terminal reply (status `continue`) from a precomputed pool of the scenario's
  own lines and states, without running the persona (constant time). The pool entry is picked by a CRC of the
  dialogue id and the message count, so replies vary (the response cache deduplicates equal replies) and are
  reproducible.
"""
from __future__ import annotations

import itertools
import logging
import time
import zlib
from collections.abc import Collection, Sequence

from llm_agent.scenario import Scenario
from llm_agent.user_sim.client import SimulatorClient, TurnFailure, TurnReply, TurnRequest, TurnResult
from llm_agent.user_sim.server.backend import BackendInputError, SamplingParams
from llm_agent.user_sim.server.scripted import ScriptedPersonaBackend

logger = logging.getLogger(__name__)

__all__ = ["INSTANCE_NAME", "InProcessUserSim"]

INSTANCE_NAME = "inprocess"
_NON_TERMINAL_LINES = ("greeting", "agree", "confused", "reluctant", "ask_who")


def never_ending_replies(scenario: Scenario, max_states: int = 8) -> list[str]:
    """The pool of `never_end` replies: each non-terminal line and step-done line with a few distinct states."""
    spec = scenario.scripted
    lines = [line for key in _NON_TERMINAL_LINES for line in spec.lines[key]]
    lines += [line for step in spec.steps for line in step.done]
    states = scenario.state_space()
    stride = max(1, len(states) // max_states)
    picked = states[::stride][:max_states]
    return [scenario.format_user_output(line, scenario.state_schema.state(state), scenario.statuses.ongoing)
            for line, state in itertools.product(lines, picked)]


class InProcessUserSim(SimulatorClient):
    """A simulator client backed by the scripted persona in this process (`acomplete` answers in the awaiting
    coroutine: the persona is quick CPU work)."""

    def __init__(self, scenario: Scenario, seed: int = 0, fail_ids: Collection[str] = (),
                 never_end: bool = False) -> None:
        if not isinstance(scenario, Scenario):
            raise TypeError(f"InProcessUserSim needs a Scenario, got {type(scenario).__name__}")
        if isinstance(fail_ids, str):
            raise TypeError("InProcessUserSim: fail_ids must be a collection of dialogue ids, not one string")
        self.scenario = scenario
        self.fail_ids = frozenset(fail_ids)
        self.never_end = never_end
        self._backend = ScriptedPersonaBackend(scenario, seed=seed)
        self._pool = never_ending_replies(scenario) if never_end else []
        self._closed = False
        self.reset_stats()

    @property
    def instances(self) -> list[str]:
        """The one pseudo-instance's name (TurnReply.instance)."""
        return [INSTANCE_NAME]

    def complete(self, requests: Sequence[TurnRequest]) -> list[TurnResult]:
        """Answer every request in order: a TurnReply, or a TurnFailure for injected faults and bad input."""
        if self._closed:
            raise RuntimeError("InProcessUserSim.complete called after close()")
        for i, req in enumerate(requests):
            if not isinstance(req, TurnRequest):
                raise TypeError(f"complete: requests[{i}] is {type(req).__name__}, expected TurnRequest")
        results = [self._complete_one(req) for req in requests]
        self._turns += len(results)
        self._failures += sum(isinstance(r, TurnFailure) for r in results)
        return results

    def _complete_one(self, req: TurnRequest) -> TurnResult:
        """One turn: injected failure, constant-time pool reply, or the scripted persona's answer."""
        start = time.perf_counter()
        if req.dialogue_id in self.fail_ids:
            return TurnFailure(req.dialogue_id, "injected failure (InProcessUserSim.fail_ids)", 1,
                               ["attempt 1: injected failure"])
        if self.never_end:
            key = zlib.crc32(f"{req.dialogue_id}|{len(req.messages)}".encode())
            return TurnReply(req.dialogue_id, self._pool[key % len(self._pool)], INSTANCE_NAME,
                             time.perf_counter() - start, 1)
        params = SamplingParams(n=1, temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                                max_tokens=req.max_tokens)
        try:
            result = self._backend.complete(req.messages, params)
        except BackendInputError as exc:
            logger.warning("in-process simulator rejected dialogue %s: %s", req.dialogue_id, exc)
            return TurnFailure(req.dialogue_id, f"request rejected: {exc}", 1, [f"attempt 1: {exc}"])
        return TurnReply(req.dialogue_id, result.choices[0].text, INSTANCE_NAME, time.perf_counter() - start, 1)

    def stats(self) -> dict[str, float]:
        """Counters in the client's naming: `user_sim/turns` and `user_sim/turn_failures`."""
        return {"user_sim/turns": float(self._turns), "user_sim/turn_failures": float(self._failures)}

    def reset_stats(self) -> None:
        """Zero the counters."""
        self._turns = 0
        self._failures = 0

    def close(self) -> None:
        """Refuse further batches (idempotent; there is nothing else to release)."""
        self._closed = True

    def __enter__(self) -> "InProcessUserSim":
        """Use as a context manager that closes on exit."""
        return self

    def __exit__(self, *exc_info) -> None:
        """Close."""
        self.close()
