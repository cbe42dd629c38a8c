"""The profile writer's conversation with the LLM: the request for one state and the checks of its answer.

`profile_request(scenario, state, ...)` renders the chat messages: the fixed scores with their meaning, the
numbered behaviour library and the JSON answer format. `check_answer(text, ...)` turns an answer into a profile
or a rejection. The scores are never taken from the answer: one that restates them differently is rejected.
Behaviours are matched by library number or text; a near-verbatim text is repaired to its library entry, an
unknown one is dropped, duplicates are dropped, more than the maximum are cut, and with a rule table
(`RuleTable`) the behaviours that contradict the state are dropped. Fewer than the minimum left, malformed JSON
or changed scores reject the answer.
"""
from __future__ import annotations

import difflib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llm_agent.profiles.rules import RuleTable
from llm_agent.scenario import Behavior, Scenario, UserProfile
from verl.utils.untrusted import load_json

__all__ = ["AnswerCheck", "SYSTEM_PROMPT", "check_answer", "profile_request"]

SYSTEM_PROMPT = ("You design believable simulated customers for training a phone agent. Given a customer's fixed "
                 "initial state, you choose the behaviours from a numbered library that such a person would "
                 "plausibly show. You never change the state and never invent behaviours. You answer with one "
                 "JSON object and nothing else.")
MAX_ANSWER_BYTES = 64 << 10  # a profile answer is a few hundred bytes
REPAIR_CUTOFF = 0.9  # difflib ratio above which a behaviour text is taken to mean that library entry
_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$", re.IGNORECASE)
_NUMBER = re.compile(r"[0-9]{1,9}")  # a library number written as text (ASCII digits: int() refuses "²")


def _normal(text: str) -> str:
    return " ".join(text.lower().split()).rstrip(".")


def profile_request(scenario: Scenario, state: Sequence[int], min_behaviors: int,
                    max_behaviors: int) -> list[dict[str, str]]:
    """The chat messages asking for `min_behaviors`..`max_behaviors` library behaviours fitting `state`."""
    lines = [f"Scenario: {scenario.name}. {' '.join(scenario.description.split())}", "",
             "The customer's initial state (fixed; do not change it):"]
    for dim, value in zip(scenario.dims, state, strict=True):
        rng = scenario.state_ranges[dim]
        about = scenario.agent_tags.abouts.get(dim, "")
        lines.append(f"- {dim}: {value} on a scale from {rng.min} to {rng.max}" + (f" ({about})" if about else ""))
    lines += ["", f"Choose {min_behaviors} to {max_behaviors} behaviours from this library that fit this "
              "customer's state together (no behaviour that contradicts it):"]
    lines += [f"{i}. [{b.category}] {b.behavior}" for i, b in enumerate(scenario.behaviors, 1)]
    example = {**dict(zip(scenario.dims, state)), "behaviors": [1, 2][:max(1, max_behaviors)]}
    lines += ["", "Answer with JSON only, the state unchanged and the behaviours as library numbers, e.g.",
              json.dumps(example)]
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "\n".join(lines)}]


@dataclass
class AnswerCheck:
    """The outcome of checking one answer: a profile (accepted, possibly repaired) or a rejection reason."""

    profile: UserProfile | None
    reject_reason: str | None = None
    repairs: list[str] = field(default_factory=list)
    detail: str = ""

    @property
    def accepted(self) -> bool:
        """True when the answer gave a profile."""
        return self.profile is not None


def _json_object(text: str) -> Any:
    body = _FENCE.sub("", text.strip())
    start, end = body.find("{"), body.rfind("}")
    if start < 0 or end < start:
        raise ValueError("no JSON object in the answer")
    return load_json(body[start:end + 1], what="the answer's JSON object", max_bytes=MAX_ANSWER_BYTES)


def _match(item: Any, library: Sequence[Behavior], by_text: Mapping[str, Behavior],
           repairs: list[str]) -> Behavior | None:
    """The library behaviour an answer item names (number, text or {"behavior": text}); None when unknown."""
    if isinstance(item, bool):
        return None
    if isinstance(item, int) or (isinstance(item, str) and _NUMBER.fullmatch(item.strip())):
        number = int(item)
        return library[number - 1] if 1 <= number <= len(library) else None
    if isinstance(item, Mapping):
        item = item.get("behavior")
    if not isinstance(item, str) or not item.strip():
        return None
    exact = by_text.get(_normal(item))
    if exact is not None:
        return exact
    close = difflib.get_close_matches(_normal(item), list(by_text), n=1, cutoff=REPAIR_CUTOFF)
    if close:
        repairs.append(f"text repaired to library entry: {item[:80]!r}")
        return by_text[close[0]]
    return None


def check_answer(text: str, state: Mapping[str, int], library: Sequence[Behavior], min_behaviors: int,
                 max_behaviors: int, rules: RuleTable | None = None,
                 ranges: Mapping[str, Any] | None = None) -> AnswerCheck:
    """Check an LLM answer for `state` ({dimension: value}; see the module docstring); `rules` with `ranges` drops
    contradictions."""
    try:
        obj = _json_object(text)
    except ValueError as exc:
        return AnswerCheck(None, "malformed", detail=str(exc))
    if not isinstance(obj, Mapping) or not isinstance(obj.get("behaviors"), list):
        return AnswerCheck(None, "malformed", detail="the JSON object has no 'behaviors' list")
    for dim, value in state.items():
        if dim in obj and obj[dim] != value:
            return AnswerCheck(None, "score_changed", detail=f"{dim} {obj[dim]!r} instead of {value}")
    repairs: list[str] = []
    by_text = {_normal(b.behavior): b for b in library}
    chosen: list[Behavior] = []
    for item in obj["behaviors"]:
        behavior = _match(item, library, by_text, repairs)
        if behavior is None:
            repairs.append(f"dropped: not in the library: {str(item)[:80]!r}")
        elif behavior in chosen:
            repairs.append(f"dropped: repeated: {behavior.behavior[:80]!r}")
        else:
            chosen.append(behavior)
    if rules is not None:
        for v in rules.violations(UserProfile(state, tuple(chosen)), ranges):
            chosen.remove(v.behavior)
            repairs.append(f"dropped: {v.behavior.category} contradicts the state ({v.condition.describe()})")
    if len(chosen) > max_behaviors:
        repairs.append(f"cut to the first {max_behaviors} of {len(chosen)} behaviours")
        chosen = chosen[:max_behaviors]
    if len(chosen) < min_behaviors:
        reason = ("out_of_library" if any("not in the library" in r for r in repairs)
                  else "inconsistent" if any("contradicts the state" in r for r in repairs) else "too_few")
        return AnswerCheck(None, reason, repairs, f"{len(chosen)} usable behaviour(s), need {min_behaviors}")
    return AnswerCheck(UserProfile(state, tuple(chosen)), None, repairs)
