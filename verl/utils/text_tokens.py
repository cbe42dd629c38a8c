"""Text from outside the policy becoming tokens: one rule for a simulator's reply, a logged dialogue and an
endpoint's answer, in the rollout, supervised fine-tuning, the warm start and evaluation.

Such text is tokenised with the tokenizer's special tokens split (``split_special_tokens=True``): ``<|im_end|>``
written by a simulator becomes the characters ``<``, ``|``, ..., never the control token that ends a turn, so a
reply cannot close its own message and open a system one. A chat template's own role markers stay control tokens:
:func:`tokenize_chat` tokenises a rendered conversation's template text as usual and the content of each message
that holds control-token text by the rule (a content without any is tokenised with the text around it, as before,
so clean conversations keep their token ids). :func:`has_control_text` tells whether a text holds control-token text
(the simulator report card flags such replies). :func:`max_token_chars` bounds the characters of one token, so a
text of n characters has at least n / max_token_chars tokens: :func:`may_fit` refuses what cannot fit a token
budget before anything is rendered or tokenised, and a budget stops tokenising once it is spent.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any

__all__ = ["COMMON_CONTROL_TEXT", "control_texts", "encode_text", "has_control_text", "max_token_chars", "may_fit",
           "tokenize_chat"]

# the control markers of the common chat templates (ChatML, Llama 3, Mistral, Gemma, Phi), whatever the tokenizer
COMMON_CONTROL_TEXT = re.compile(r"<\|[A-Za-z0-9_.:-]{1,64}\|>|</?s>|\[/?INST\]|<(?:start|end)_of_turn>")
_SLOT = "\ue000{}\ue001"  # private-use characters: a message content's place in a rendering
_SLOT_RE = re.compile("\ue000(\\d+)\ue001")


@lru_cache(maxsize=16)
def control_texts(tokenizer: Any) -> tuple[str, ...]:
    """The text of every special token of `tokenizer` (its special-tokens map and added tokens marked special)."""
    found = set(getattr(tokenizer, "all_special_tokens", None) or ())
    found |= {t.content for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values() if t.special}
    return tuple(sorted(t for t in found if t))


def has_control_text(text: str, extra: Iterable[str] = ()) -> bool:
    """Whether `text` holds control-token text: a common template marker or one of `extra` (e.g. control_texts)."""
    return COMMON_CONTROL_TEXT.search(text) is not None or any(t in text for t in extra)


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of outside text: no BOS/EOS added, special tokens split (see the module docstring)."""
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)


@lru_cache(maxsize=16)
def max_token_chars(tokenizer: Any) -> int:
    """The longest vocabulary entry in characters (byte-level entries count bytes): no token covers more of a text
    (a normalizer that deletes characters could; causal LMs' tokenizers have none)."""
    return max(1, max((len(t) for t in tokenizer.get_vocab()), default=1))


def may_fit(tokenizer: Any, texts: Iterable[str], max_tokens: int) -> bool:
    """False when `texts` together certainly tokenise to more than `max_tokens` tokens (counted without
    tokenising: their characters over :func:`max_token_chars`); True means they may fit."""
    return sum(len(t) for t in texts) <= max_tokens * max_token_chars(tokenizer)


def _content_spans(tokenizer: Any, messages: Sequence[Mapping[str, str]], rendered: str, generation_prompt: bool,
                   wanted: set[int]) -> list[tuple[int, int]]:
    """(start, end) in `rendered` of the contents of messages `wanted`, found by rendering each content as a slot
    marker; ValueError when the template changes a content (then its text cannot be placed)."""
    slotted = [{**m, "content": _SLOT.format(i)} for i, m in enumerate(messages)]
    template = tokenizer.apply_chat_template(slotted, tokenize=False, add_generation_prompt=generation_prompt)
    spans, out, last = [], [], 0
    for match in _SLOT_RE.finditer(template):
        out.append(template[last:match.start()])
        start = sum(map(len, out))
        i = int(match.group(1))
        out.append(messages[i]["content"])
        if i in wanted:
            spans.append((start, start + len(messages[i]["content"])))
        last = match.end()
    out.append(template[last:])
    if not "".join(out).startswith(rendered):  # `rendered` may stop early (a budget already spent)
        raise ValueError("the chat template changes a message that holds control-token text, so its text cannot be "
                         "tokenised apart from the template's markers")
    return spans


def tokenize_chat(tokenizer: Any, messages: Sequence[Mapping[str, str]], pieces: Sequence[tuple[str, int]],
                  generation_prompt: bool = False, max_tokens: int | None = None, cut: bool = True
                  ) -> tuple[list[int], list[int]] | None:
    """(token ids, flag per token) of a rendered conversation given as `pieces` ((text, flag) whose concatenation
    is `messages` rendered by the chat template with `generation_prompt`, or its beginning when a budget stops the
    caller early; a flag marks e.g. loss-carrying text).
    Each piece is tokenised on its own (no token straddles two), the contents of messages holding control-token
    text by :func:`encode_text`. With `max_tokens`, tokenising stops once they are spent: the ids are cut there
    (`cut`) or None is returned (the conversation does not fit)."""
    rendered = "".join(text for text, _ in pieces)
    specials = control_texts(tokenizer)
    wanted = {i for i, m in enumerate(messages) if has_control_text(m["content"], specials)}
    spans = _content_spans(tokenizer, messages, rendered, generation_prompt, wanted) if wanted else []
    runs: list[tuple[str, int, bool]] = []
    at = 0
    for text, flag in pieces:
        end, pos = at + len(text), at
        for lo, hi in spans:
            lo, hi = max(lo, pos), min(hi, end)
            if lo < hi:
                runs += [(rendered[pos:lo], flag, False), (rendered[lo:hi], flag, True)]
                pos = hi
        runs.append((rendered[pos:end], flag, False))
        at = end
    ids: list[int] = []
    flags: list[int] = []
    per_token = max_token_chars(tokenizer)
    for text, flag, split in runs:
        if not text:
            continue
        if max_tokens is not None:
            text = text[:(max_tokens - len(ids) + 1) * per_token]  # more than the budget's worth: not tokenised
        piece = encode_text(tokenizer, text) if split else tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        flags += [flag] * len(piece)
        if max_tokens is not None and len(ids) > max_tokens:
            return (ids[:max_tokens], flags[:max_tokens]) if cut else None
    return ids, flags
