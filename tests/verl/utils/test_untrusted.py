"""Tests of verl.utils.untrusted: the size/depth limits, cleaned text, and refusals that name their input."""
import json
import random

import pytest

from verl.utils.untrusted import UntrustedInputError, clean_text, json_depth, load_json


def _depth_by_recursion(value) -> int:
    if isinstance(value, list):
        return 1 + max((_depth_by_recursion(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth_by_recursion(v) for v in value.values()), default=0)
    return 0


def _random_value(rng: random.Random, depth: int):
    kind = rng.randrange(5 if depth < 6 else 3)
    if kind == 0:
        return rng.choice([1, -2.5, None, True])
    if kind == 1:
        return rng.choice(["plain", "with [brackets] {inside}", 'escaped \\" quote ]]', "\\"])
    if kind == 2:
        return rng.choice([[], {}])
    if kind == 3:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(1, 4))]
    return {f"k{i}]": _random_value(rng, depth + 1) for i in range(rng.randrange(1, 4))}


def test_depth_matches_the_decoded_structure_on_random_documents():
    rng = random.Random(0)
    for _ in range(300):
        value = _random_value(rng, 0)
        assert json_depth(json.dumps(value).encode()) == _depth_by_recursion(value)


def test_deeply_nested_documents_are_refused_without_recursion():
    for doc in ("[" * 100_000 + "]" * 100_000, '{"a":' * 50_000 + "1" + "}" * 50_000, "[" * 200_000):
        with pytest.raises(UntrustedInputError, match="simulator reply: JSON nested .* levels deep"):
            load_json(doc, what="simulator reply", max_bytes=1 << 20)
    assert load_json("[" * 64 + "]" * 64, what="x", max_bytes=1000) is not None
    with pytest.raises(UntrustedInputError, match="65 levels"):
        load_json("[" * 65 + "]" * 65, what="x", max_bytes=1000)


def test_size_limit_and_invalid_json_name_the_input():
    with pytest.raises(UntrustedInputError, match=r"cache line 3: 11 bytes, over the limit of 10"):
        load_json('"abcdefghi"', what="cache line 3", max_bytes=10)
    with pytest.raises(UntrustedInputError, match="models list: not valid JSON"):
        load_json(b"{'no': json}", what="models list", max_bytes=100)
    with pytest.raises(UntrustedInputError, match="not valid JSON"):
        load_json(b"\xff\xfe\x00garbage", what="reply", max_bytes=100)


def test_non_finite_numbers_are_refused():
    for doc in ('{"kl": NaN}', "[Infinity]", "-Infinity"):
        with pytest.raises(UntrustedInputError, match="non-finite"):
            load_json(doc, what="state", max_bytes=100)


def test_lone_surrogates_and_nul_are_replaced_everywhere():
    doc = '{"reply": "hi \\ud800 there", "\\udfffkey": ["\\u0000", "ok \\ud83d\\ude00"]}'
    value = load_json(doc, what="reply", max_bytes=1000)
    assert value == {"reply": "hi \ufffd there", "\ufffdkey": ["\ufffd", "ok \U0001F600"]}
    for text in value["reply"], *value:
        text.encode("utf-8")  # must not raise
    assert clean_text("plain ascii") == "plain ascii"
    assert clean_text("caf\u00e9 \ud800") == "caf\u00e9 \ufffd"
    raw_str = json.loads('"\\udc80"')  # what the standard decoder lets through
    assert clean_text(raw_str) == "\ufffd"


def test_bytes_must_be_utf8_even_with_a_byte_order_mark():
    """json.loads(bytes) guesses UTF-16/32 from a BOM: a cache file re-saved as UTF-16 was read as valid lines."""
    doc = '{"reply": "hi"}'
    assert load_json(doc.encode("utf-8"), what="line", max_bytes=100) == {"reply": "hi"}
    for encoding in ("utf-16", "utf-32"):
        assert json.loads(doc.encode(encoding)) == {"reply": "hi"}
        with pytest.raises(UntrustedInputError, match="line: not valid JSON"):
            load_json(doc.encode(encoding), what="line", max_bytes=100)
