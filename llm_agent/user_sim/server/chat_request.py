"""Validation of an OpenAI chat-completions request body (`parse_chat_request`) and the error it raises.

Every problem is an :class:`ApiError` (400) naming the offending field, answered by the server in OpenAI's error
shape. Unknown OpenAI fields are accepted and ignored. The cost is linear in the body size (one `json.loads`,
then one pass over the messages).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_MESSAGES = 512

MAX_N = 128
SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)  # what torch.manual_seed accepts (hf backend)
ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """An HTTP error answered in OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


@dataclass
class ChatRequest:
    """A validated chat-completions request (unknown OpenAI fields are accepted and ignored)."""

    model: str
    messages: list[dict[str, str]]
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int | None = None
    stream: bool = False
    stop: list[str] = field(default_factory=list)


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text(where: str, value: str) -> str:
    """`value` unchanged, or a 400 when it holds a lone surrogate (JSON allows "\\ud800"; UTF-8 does not)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise _bad(where, f"not valid Unicode text ({err.reason} at position {err.start})") from None
    return value


def _number(body: dict, key: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if not (_is_int(value) or isinstance(value, float)):
        raise _bad(key, f"expected a finite number, got {value!r}")
    try:
        number = float(value)  # an integer literal too large for a float raises OverflowError
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise _bad(key, f"expected a finite number, got {str(value)[:40]}")
    value = number
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise _bad(key, f"{value} is outside {bracket}{low}, {high}]")
    return float(value)


def _message_text(index: int, message: Any) -> dict[str, str]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise _bad(where, f"expected an object with 'role' and 'content', got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise _bad(f"{where}.role", f"expected one of {ROLES}, got {role!r}")
    content = message.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"{where}.content[{j}]", "only {'type': 'text', 'text': str} parts are supported")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise _bad(f"{where}.content", f"expected a string or a list of text parts, got {type(content).__name__}")
    return {"role": role, "content": _text(f"{where}.content", content)}


def parse_chat_request(raw: bytes, max_messages: int = DEFAULT_MAX_MESSAGES) -> ChatRequest:
    """Validate a chat-completions body; raise ApiError(400) naming the offending field."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise ApiError(400, f"request body is not valid JSON: {err}", code="invalid_json") from err
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", f"a non-empty string is required, got {model!r}")
    _text("model", model)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "a non-empty list of messages is required")
    if len(messages) > max_messages:
        raise _bad("messages", f"{len(messages)} messages exceed this server's limit of {max_messages}")
    n = body.get("n", 1)
    n = 1 if n is None else n
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise _bad("n", f"expected an integer in [1, {MAX_N}], got {n!r}")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        raise _bad("seed", f"expected an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}] or null, "
                           f"got {str(seed)[:40]}")
    max_tokens = None
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None:
            if not _is_int(value) or value < 1:
                raise _bad(key, f"expected a positive integer, got {value!r}")
            max_tokens = value
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise _bad("stream", f"expected a boolean, got {stream!r}")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) for s in stop):
        raise _bad("stop", "expected a string or a list of at most 4 strings")
    stop = [_text(f"stop[{i}]", s) for i, s in enumerate(stop)]
    return ChatRequest(
        model=model,
        messages=[_message_text(i, m) for i, m in enumerate(messages)],
        n=n,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        seed=seed,
        max_tokens=max_tokens,
        stream=bool(stream),
        stop=stop,
    )
