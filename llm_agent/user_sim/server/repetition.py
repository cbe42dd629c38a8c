"""The scripted persona's repetition check: is an agent turn (nearly) the same words as an earlier one?

Turns are compared as lower-cased word/punctuation tokens (words cut at 40 characters, at most
REPETITION_MAX_TOKENS per turn), so one comparison costs a bounded amount whatever the turn's length. An exact
repeat is found at any distance through a digest of every turn; a near repeat (similarity ratio >=
REPETITION_SIMILARITY) among the last REPETITION_WINDOW turns, so a turn's cost does not grow with the dialogue.
"""
from __future__ import annotations

import difflib
import hashlib
import itertools
import re

REPETITION_SIMILARITY = 0.9
REPETITION_MAX_TOKENS = 400
REPETITION_WINDOW = 16
_REPEAT_TOKEN_RE = re.compile(r"\w{1,40}|[^\w\s]")  # a hostile 1 MB "word" is cut into 40-character pieces
_SEP = "\x1f"  # joins a turn's tokens (a control character that no token contains)


def capped_tokens(text: str) -> list[str]:
    """The first REPETITION_MAX_TOKENS lower-cased word/punctuation tokens of `text` (cost bounded by the cap)."""
    return [m.group(0) for m in itertools.islice(_REPEAT_TOKEN_RE.finditer(text.lower()), REPETITION_MAX_TOKENS)]


def similar_tokens(ta: list[str], tb: list[str], matcher: difflib.SequenceMatcher | None = None) -> bool:
    """True when two token lists are (nearly) the same: similarity ratio >= REPETITION_SIMILARITY.

    `matcher` may already hold `tb` as its second sequence (its indexes are then reused).
    """
    if not ta or not tb:
        return ta == tb
    if matcher is None:
        matcher = difflib.SequenceMatcher(None, autojunk=False)
        matcher.set_seq2(tb)
    matcher.set_seq1(ta)
    return (matcher.real_quick_ratio() >= REPETITION_SIMILARITY and matcher.quick_ratio() >= REPETITION_SIMILARITY
            and matcher.ratio() >= REPETITION_SIMILARITY)


def similar_to_any(tokens: list[str], recent: tuple[str, ...]) -> bool:
    """True when `tokens` is (nearly) the same as one of the `recent` joined token lists."""
    if not recent:
        return False
    matcher = difflib.SequenceMatcher(None, autojunk=False)
    matcher.set_seq2(tokens)
    return any(similar_tokens(earlier.split(_SEP) if earlier else [], tokens, matcher) for earlier in recent)


def similar(a: str, b: str) -> bool:
    """True when two agent turns are (nearly) the same: word-level similarity >= REPETITION_SIMILARITY.

    Compares lower-cased word/punctuation tokens, at most REPETITION_MAX_TOKENS of each, so the cost stays
    bounded whatever the length of the turns.
    """
    return similar_tokens(capped_tokens(a), capped_tokens(b))


def fingerprint(text: str) -> tuple[list[str], str, bytes]:
    """(capped tokens, the tokens joined for storage, a 16-byte digest of them) of one agent turn."""
    tokens = capped_tokens(text)
    joined = _SEP.join(tokens)
    return tokens, joined, hashlib.blake2b(joined.encode("utf-8", "surrogatepass"), digest_size=16).digest()
