"""The simulator-client contract: what the rollout loop asks of anything that answers user turns.

`SimulatorClient` is implemented by the HTTP client over N instances (`UserSimClient`), the in-process scripted
simulator (`llm_agent.stand_ins.inprocess_user_sim`) and the tests' fakes. A request is a `TurnRequest` (one
dialogue's rendered simulator messages and decoding parameters); an answer is a `TurnReply` (the simulator's text)
or a `TurnFailure` (no instance answered; never a made-up reply). The sync rollout loop sends each round of turns
as one `complete` call; the async loop runs its dialogues inside `run_on_loop` and awaits `acomplete` per turn.

A reply's text is outside input: `TurnReply` cleans it (`verl.utils.untrusted.clean_text`: lone surrogates and NUL
become U+FFFD) whatever client built it, so it can always reach a tokenizer, a cache file or a log. A caller that
refuses a reply (it breaks the scenario's tag protocol) re-requests the turn with that reply's instance appended
to `TurnRequest.avoid`: the client then sends it elsewhere when it can and counts the refusal against that
instance, so an instance whose replies are useless loses its share of the traffic.
"""
from __future__ import annotations

import abc
import asyncio
import math
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, Union, runtime_checkable

from verl.utils.untrusted import clean_text

__all__ = ["SimulatorClient", "TurnFailure", "TurnReply", "TurnRequest", "TurnResult"]

T = TypeVar("T")


@dataclass(frozen=True)
class TurnRequest:
    """One dialogue's next user turn: the rendered chat messages for the simulator and the decoding parameters.

    `avoid`: the instances (`TurnReply.instance`) whose earlier replies to this turn the caller refused, in order;
    each re-request appends the instance of the reply it replaces, so the last one is the newest refusal.
    """

    dialogue_id: str
    messages: list[dict]
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int | None = None
    avoid: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        where = f"TurnRequest(dialogue_id={self.dialogue_id!r})"
        if not isinstance(self.messages, list) or not self.messages:
            raise ValueError(f"{where}: messages must be a non-empty list of dicts")
        for i, message in enumerate(self.messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ValueError(f"{where}: messages[{i}] must be a dict with a string 'role', got {message!r}")
            if not isinstance(message.get("content"), str):
                raise ValueError(f"{where}: messages[{i}]['content'] must be a string")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"{where}: temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"{where}: top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"{where}: max_tokens must be >= 1, got {self.max_tokens}")
        if not isinstance(self.avoid, tuple) or not all(isinstance(name, str) for name in self.avoid):
            raise ValueError(f"{where}: avoid must be a tuple of instance names, got {self.avoid!r}")


@dataclass(frozen=True)
class TurnReply:
    """A simulator's answer: its text (cleaned, see the module docstring), the instance (host:port) that served it,
    the answering request's latency in seconds, and how many attempts the turn took (1 = no retry)."""

    dialogue_id: str
    text: str
    instance: str
    latency_s: float
    attempts: int

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise TypeError(f"TurnReply(dialogue_id={self.dialogue_id!r}): text must be a str, "
                            f"got {type(self.text).__name__}")
        object.__setattr__(self, "text", clean_text(self.text))


@dataclass(frozen=True)
class TurnFailure:
    """A turn no instance answered: why, after how many attempts, and each attempt's error."""

    dialogue_id: str
    reason: str
    attempts: int
    errors: list[str] = field(default_factory=list)


TurnResult = Union[TurnReply, TurnFailure]


@runtime_checkable
class SimulatorClient(Protocol):
    """Answers dialogue turns; see the module docstring.

    `complete` is the one method an implementation must write. Subclassing this protocol gives the others'
    defaults: `acomplete` answers through `complete` in the awaiting coroutine (right for a fast in-process
    simulator; an I/O client overrides it), `run_on_loop` runs a coroutine on a new event loop (a client with a
    loop of its own, where `acomplete` must be awaited, overrides it), `stats` is empty, `reset_stats` and `close`
    do nothing.
    """

    @abc.abstractmethod
    def complete(self, requests: Sequence[TurnRequest]) -> list[TurnResult]:
        """One TurnReply or TurnFailure per request, in order (the requests may be served concurrently)."""

    async def acomplete(self, request: TurnRequest) -> TurnResult:
        """The answer to one request; awaited inside `run_on_loop`."""
        results = self.complete([request])
        if len(results) != 1:
            raise RuntimeError(f"{type(self).__name__}.complete answered {len(results)} results for 1 request")
        return results[0]

    def run_on_loop(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run `coroutine` (which awaits `acomplete`) to its end on the event loop `acomplete` belongs to."""
        return asyncio.run(coroutine)

    def stats(self) -> dict[str, float]:
        """Counters since the last `reset_stats`, as `user_sim/...` metrics."""
        return {}

    def reset_stats(self) -> None:
        """Zero the counters."""

    def close(self) -> None:
        """Release connections and threads (idempotent); servers are left running."""
