"""The types a user-simulator backend works with, and the protocol the server needs from one.

`python -m llm_agent.user_sim.server` serves `POST /v1/chat/completions`, `GET /v1/models` and `GET /health`
with one of two backends: `scripted` (a deterministic, seeded persona driven by the scenario YAML's cues) or
`hf` (a transformers causal LM). Both implement :class:`ChatBackend`; the server owns HTTP, validation, auth
and the optional injected faults (`faults.py`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class BackendInputError(ValueError):
    """A request the backend cannot serve because of its content (answered with HTTP 400, never 500)."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters, already validated by the server."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int | None = None


@dataclass(frozen=True)
class Completion:
    """One generated choice: its text, why it stopped ('stop' or 'length') and its token count."""

    text: str
    finish_reason: str
    completion_tokens: int


@dataclass(frozen=True)
class BackendResult:
    """All choices of one request plus the prompt's token count (for the `usage` block)."""

    choices: list[Completion]
    prompt_tokens: int


class ChatBackend(Protocol):
    """What the server needs from a backend: a blocking `complete` (run in a worker thread)."""

    def complete(self, messages: list[dict[str, str]], params: SamplingParams) -> BackendResult:
        """Return `params.n` completions of the chat `messages` (each a {'role', 'content'} dict)."""
        ...


__all__ = ["BackendInputError", "BackendResult", "ChatBackend", "Completion", "SamplingParams"]
