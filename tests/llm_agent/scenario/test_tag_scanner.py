"""The linear tag scanner: same answers as the documented regex semantics, in time linear in the input.

The reference below is the lazy-regex definition of docs/scenario_schema.md "Parsing rules" (quadratic on hostile
input, so it only sees short random texts here); the scanner must agree with it on every input.
"""
from __future__ import annotations

import re
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from llm_agent.scenario import DEFAULT_SCENARIO_PATH, load_scenario
from llm_agent.scenario.tags import extract_tag, strip_tags

SCENARIO = load_scenario(DEFAULT_SCENARIO_PATH)
TAGS = ["reply", "stage", "user_reply"]


def _block(tag: str) -> re.Pattern:
    t = re.escape(tag)
    return re.compile(r"<\s*" + t + r"\s*>(.*?)<\s*/\s*" + t + r"\s*>", re.IGNORECASE | re.DOTALL)


def _any(tags: list[str]) -> re.Pattern:
    return re.compile(r"<\s*/?\s*(?:" + "|".join(map(re.escape, tags)) + r")\s*>", re.IGNORECASE)


def reference_extract(text: str, tag: str, all_tags: list[str]):
    blocks = _block(tag).findall(text)
    if blocks:
        return blocks[-1], (["multiple"] if len(blocks) > 1 else [])
    openings = list(re.finditer(r"<\s*" + re.escape(tag) + r"\s*>", text, re.IGNORECASE))
    if not openings:
        return None, ["missing"]
    rest = text[openings[-1].end():]
    nxt = _any(all_tags).search(rest)
    return (rest[:nxt.start()] if nxt else rest), ["unclosed"]


def reference_strip(text: str, tags: list[str]):
    count = 0
    for tag in tags:
        text, n = _block(tag).subn(" ", text)
        count += n
    text, n = _any(tags).subn(" ", text)
    count += n
    return (" ".join(text.split()) if count else text), count > 0


_pieces = st.sampled_from(["<reply>", "</reply>", "< Reply >", "< / REPLY>", "<stage>", "</stage>", "<user_reply>",
                           "</ user_reply >", "<other>", "</other>", "<", ">", "/", " ", "\n", "a", "1", "<<", "< /",
                           "<reply", "reply>", "\t"])


@settings(max_examples=400, deadline=None)
@given(st.lists(_pieces, max_size=30).map("".join), st.sampled_from(TAGS))
def test_scanner_agrees_with_the_regex_definition(text, tag):
    assert extract_tag(text, tag, TAGS) == reference_extract(text, tag, TAGS)
    assert strip_tags(text, TAGS) == reference_strip(text, TAGS)


def _best_time(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def test_hostile_tag_soup_parses_in_linear_time():
    """192 KB of openings took 46 s with the lazy regexes (quadratic); the scanner needs ~30 ms."""
    for text in ("<user_reply>" * 16000, "<" + " " * 200_000, "< /" * 60_000, "<user_reply" * 16000):
        assert _best_time(lambda: (SCENARIO.parse_user_output(text), SCENARIO.parse_agent_output(text))) < 3.0
        assert SCENARIO.parse_user_output(text).parse_error
    short = _best_time(lambda: SCENARIO.parse_user_output("<user_reply>" * 10_000))
    long = _best_time(lambda: SCENARIO.parse_user_output("<user_reply>" * 80_000))
    assert long < 24 * short + 0.05  # 8x the input: linear is ~8x, quadratic ~64x
