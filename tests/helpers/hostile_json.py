"""Test helper: Hypothesis strategies for hostile outside input (JSON values with lone surrogates, NaN and deep
nesting, raw bytes, torn and overlong lines) and the probes of issue 29 as fixed seeds."""
from __future__ import annotations

import json

from hypothesis import strategies as st

SURROGATES = ("\ud800", "\udfff", "\udc80")
DEEP = 100_000  # levels: far past the recursion limit of a naive decoder
NESTED_PROBES = (b"[" * DEEP + b"]" * DEEP, b'{"a": ' * DEEP + b"1" + b"}" * DEEP)


def nested_json() -> st.SearchStrategy[bytes]:
    """Objects nested 2 to 2,000 levels deep (the probes above, cut to a size that keeps examples fast)."""
    return st.integers(2, 2000).map(lambda n: b'{"a": ' * n + b"1" + b"}" * n)


def hostile_text(max_size: int = 24) -> st.SearchStrategy[str]:
    """Text mixing any code point with lone surrogates (what a JSON `\\udXXX` escape decodes to)."""
    return st.lists(st.one_of(st.characters(), st.sampled_from(SURROGATES)), max_size=max_size).map("".join)


def json_values(max_leaves: int = 12) -> st.SearchStrategy:
    """JSON-shaped values: null, booleans, huge integers, floats incl. NaN and infinities, hostile text, and lists
    and objects of them."""
    leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), hostile_text())
    return st.recursive(leaves, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(hostile_text(8), inner, max_size=4), max_leaves=max_leaves)


def dumps(value) -> bytes:
    """`value` as JSON bytes the way a hostile peer sends it: NaN/Infinity literals, surrogates as escapes."""
    return json.dumps(value, allow_nan=True).encode("ascii")


def completion_body(content) -> bytes:
    """A chat-completion body whose message content is `content` (any JSON value)."""
    return dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                               "finish_reason": "stop"}]})


def reply_bodies() -> st.SearchStrategy[bytes]:
    """What an OpenAI-compatible endpoint may answer: raw bytes, any JSON, a completion with any content, a
    truncated completion, or deeply nested JSON."""
    return st.one_of(st.binary(max_size=64), json_values().map(dumps), json_values().map(completion_body),
                     hostile_text().map(completion_body),
                     st.tuples(hostile_text().map(completion_body), st.integers(1, 40)).map(lambda p: p[0][:-p[1]]),
                     nested_json(), st.integers(2, 2000).map(lambda n: b"[" * n + b"]" * n))
