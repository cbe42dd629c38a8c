"""One policy for input from outside the process: JSON decoded within a size and a nesting limit, and text
cleaned of what breaks tokenizers, UTF-8 writers and logs.

Everything that parses a reply from a server, a line of a file another run wrote, or a request body goes
through `load_json`; everything that passes such text on to a tokenizer, a cache file or a log goes through
`clean_text` (`load_json` already applies it to every string it returns). Cost is linear in the input's size:
the nesting depth is measured with one regex pass and C-level byte scans before the standard decoder runs, so a
deeply nested document is refused without recursion.
"""
from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

__all__ = ["DEFAULT_MAX_DEPTH", "UntrustedInputError", "clean_text", "json_depth", "load_json"]

DEFAULT_MAX_DEPTH = 64  # far deeper than any chat completion, config or record this project reads

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # a JSON string literal (unrolled: linear)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class UntrustedInputError(ValueError):
    """Outside input refused: too large, nested too deep, or not JSON. The message names what was read."""


def json_depth(data: bytes) -> int:
    """The deepest nesting of arrays/objects in `data`, brackets inside string literals ignored (an upper
    bound for malformed input)."""
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    if sum(map(brackets.count, (b"[", b"{"))) <= 1:
        return min(1, len(brackets))
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1).astype(np.int64)
    return int(max(0, steps.cumsum().max()))


def clean_text(text: str) -> str:
    """`text` with lone UTF-16 surrogates (which no UTF-8 encoder or tokenizer accepts) and NUL characters
    replaced by U+FFFD; other text unchanged."""
    if text.isascii():
        return text.replace("\x00", "\ufffd") if "\x00" in text else text
    return _LONE_SURROGATE.sub("\ufffd", text).replace("\x00", "\ufffd")


def _clean(value: Any) -> Any:
    """`value` with `clean_text` applied to every string in it (keys included)."""
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, list):
        return [_clean(v) for v in value]
    if isinstance(value, dict):
        return {clean_text(k): _clean(v) for k, v in value.items()}
    return value


def load_json(data: bytes | str, *, what: str, max_bytes: int, max_depth: int = DEFAULT_MAX_DEPTH,
              clean: bool = True) -> Any:
    """Decode `data` (UTF-8 when bytes) as JSON, refusing more than `max_bytes` bytes or `max_depth` levels of
    nesting (UntrustedInputError naming `what`); every string of the result is `clean_text`-ed. NaN and Infinity
    literals are refused too: no outside number may be non-finite, and so are bytes in another encoding (the
    standard decoder would guess UTF-16 or UTF-32 from a byte-order mark). `clean=False` leaves the strings as
    decoded, for a caller that joins pieces of text first (a surrogate pair split between two) and cleans the
    whole."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if len(raw) > max_bytes:
        raise UntrustedInputError(f"{what}: {len(raw)} bytes, over the limit of {max_bytes}")
    depth = json_depth(raw)
    if depth > max_depth:
        raise UntrustedInputError(f"{what}: JSON nested {depth} levels deep, over the limit of {max_depth}")
    try:
        value = json.loads(raw.decode("utf-8", "surrogatepass"), parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise UntrustedInputError(f"{what}: not valid JSON ({_short(exc)})") from None
    return _clean(value) if clean else value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


def _short(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) <= 200 else text[:200] + "..."
