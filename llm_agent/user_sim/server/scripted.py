"""Scripted persona backend: a deterministic simulated user driven by the scenario YAML's `scripted` data.

Stateless over HTTP: every request carries the whole conversation (persona system message, then the agent's
turns as `user` messages and this persona's own earlier replies as `assistant` messages). The backend reads the
profile back from the persona (`Scenario.recover_profile`), replays every agent turn through
:class:`ScriptedPersona` (the reference semantics of docs/scenario_schema.md section 5), re-syncs the state
with the state tags of the persona's own earlier replies, and answers the last agent turn with
`Scenario.format_user_output`. The state transitions depend only on the profile and the agent's words; the
request seed (hashed with the persona text, the server seed, the turn and the choice index) only picks the
wording among a line's variants, and temperature 0 always picks the first variant.

Where the reference semantics leave room, this implementation chooses:
- hang-up (status `ended`) when a dimension of `hang_up_at` *worsens* to its threshold in this turn (falls to it,
  or rises to it for a dimension where lower is better; a user who starts there can still be won over), when a
  voiced doubt stays unanswered for more than `doubt_patience` agent turns, or when the agent says goodbye before
  the task is complete;
- `self_intro` and `organisation` may be heard in different turns; the first answer after the introduction is
  the greeting followed by the first doubt;
- doubts are raised one at a time in profile order; only a voiced doubt can be resolved; a behaviour whose
  category has no `scripted.categories` entry is not raised;
- steps count only after the introduction with no doubt pending (the turn that settles the last doubt may also
  guide the first step); guiding a later step before the current one is `step_out_of_order`;
- a turn over `rules.max_words` words (or over `max_words * MAX_CHARS_PER_WORD` characters, so the cost of
  reading a hostile turn stays small; only that many first characters are searched for pushy or robotic cues)
  or hitting more than `rules.max_topics` task cue lists is overloaded:
  nothing in it counts and the `overloaded` effect applies (a repeated keyword soup can never complete);
- a step is performed only when the state passes every `act_min_<dimension>` / `act_max_<dimension>` gate;
- one step per turn: a turn that also guides a later step performs neither (`step_out_of_order`);
- repetition means the same words as any earlier agent turn of the conversation, or nearly the same words as
  one of the last REPETITION_WINDOW agent turns (a bounded window keeps a turn's cost independent of the
  dialogue's length; real dialogues are far shorter than the window);
- completion (status `completed`) needs every step done, in order, in earlier turns and then a `confirmation` cue.
Token counts (`usage`, `max_tokens` truncation with finish_reason 'length') count words and punctuation marks.
"""
from __future__ import annotations

import copy
import hashlib
import logging
import random
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from llm_agent.scenario import Behavior, Scenario, ScriptedSpec, UserProfile, UserTurn, load_scenario
from llm_agent.user_sim.server.backend import BackendInputError, BackendResult, Completion, SamplingParams
from llm_agent.user_sim.server.repetition import REPETITION_WINDOW, fingerprint, similar_to_any

logger = logging.getLogger(__name__)

MAX_CHARS_PER_WORD = 40  # a turn longer than max_words * this many characters is over-long, whatever its words
PERSONA_BASE_BYTES = 2048  # a persona's fixed footprint in the cache's byte estimate
_TOKEN_RE = re.compile(r"\w+|[^\w\s]")


@dataclass(frozen=True)
class TurnOutcome:
    """The persona's reaction to one agent turn: events seen, what kind of line to say, and the status.

    `line` is a `scripted.lines` key, or ("doubt", category) / ("done", step index) for those lines;
    `prefix` is an optional line key said first (the greeting before a first doubt); `status` is one of the
    scenario's status values.
    """

    events: tuple[str, ...]
    line: str | tuple[str, object]
    status: int
    prefix: str | None = None


@dataclass
class ScriptedPersona:
    """The simulated user's evolving state for one conversation; `react` consumes one agent turn."""

    scenario: Scenario
    profile: UserProfile
    state: dict[str, int] = field(init=False)
    heard_self_intro: bool = False
    heard_organisation: bool = False
    introduced: bool = False
    greeted: bool = False
    doubt_index: int = 0
    doubt_voiced: bool = False
    doubt_open_turns: int = 0
    steps_done: int = 0
    steps_done_before_turn: int = 0
    status: int | None = None  # the scenario's `ongoing` status until the call ends
    recent_turns: tuple[str, ...] = ()  # the last REPETITION_WINDOW agent turns as joined capped tokens
    turn_digests: frozenset[bytes] = frozenset()  # digests of every agent turn's capped tokens
    furthest_stage: int = -1
    spec: ScriptedSpec = field(init=False)
    doubts: list[Behavior] = field(init=False)

    def __post_init__(self) -> None:
        self.state = dict(self.profile.state)
        self.spec = self.scenario.scripted
        if self.status is None:
            self.status = self.scenario.statuses.ongoing
        known = self.spec.categories
        self.doubts = [b for b in self.profile.behaviors if b.category in known]
        skipped = [b.behavior for b in self.profile.behaviors if b.category not in known]
        if skipped:
            logger.debug("behaviours without a scripted category are not raised: %s", skipped)

    @property
    def doubt_pending(self) -> bool:
        """True while some behaviour's doubt has not been resolved."""
        return self.doubt_index < len(self.doubts)

    def topics(self, text: str) -> int:
        """How many distinct task cue lists `text` hits: stages, steps, doubt answers and the confirmation."""
        spec = self.spec
        lists = [*spec.stage_cues.values(), *(s.guide for s in spec.steps),
                 *(c.resolve for c in spec.categories.values()), spec.cues["confirmation"]]
        return sum(1 for cues in lists if cues.matches(text))

    def _detect(self, text: str) -> tuple[list[str], dict[str, bool]]:
        cues, steps, rules = self.spec.cues, self.spec.steps, self.spec.rules
        limit = rules.max_words * MAX_CHARS_PER_WORD
        too_long = len(text) > limit or count_words(text) > rules.max_words
        heard = ("pushy", "robotic") if too_long else tuple(cues)  # an over-long turn is not taken in: only its
        seen = {key: key in heard and cues[key].matches(text[:limit]) for key in cues}  # start is heard
        events = [key for key in ("pushy", "robotic") if seen[key]]
        if self._repeats(text):
            events.append("repetition")
        seen["guided_next"] = False
        self.steps_done_before_turn = self.steps_done
        seen["overloaded"] = too_long or self.topics(text) > rules.max_topics
        if seen["overloaded"]:
            # Too long or keyword-stuffed: the user takes nothing in (no introduction, answer, step or
            # confirmation counts), an open doubt stays ignored, and the turn is penalised.
            events.append("overloaded")
            if self.introduced and self.doubt_pending and self.doubt_voiced:
                events.append("doubt_ignored")
                self.doubt_open_turns += 1
            return events, {**{key: False for key in seen}, "overloaded": True}
        if seen["empathy"]:
            events.insert(0, "empathy")
        self.heard_self_intro |= seen["self_intro"]
        self.heard_organisation |= seen["organisation"]
        was_introduced = self.introduced
        if not self.introduced and self.heard_self_intro and self.heard_organisation:
            self.introduced = True
            events.append("introduced")
        stages = [pos for pos, sid in enumerate(self.scenario.stage_ids) if self.spec.stage_cues[sid].matches(text)]
        if stages and max(stages) > self.furthest_stage:
            self.furthest_stage = max(stages)
            events.append("stage_progress")
        on_topic = bool(stages) or any(s.guide.matches(text) for s in steps)
        useful = on_topic or any(seen[k] for k in ("self_intro", "organisation", "empathy", "confirmation"))
        if was_introduced and self.doubt_pending and self.doubt_voiced:
            if self.spec.categories[self.doubts[self.doubt_index].category].resolve.matches(text):
                events.append("doubt_resolved")
                self.doubt_index, self.doubt_voiced, self.doubt_open_turns = self.doubt_index + 1, False, 0
                useful = True
            else:
                events.append("doubt_ignored")
                self.doubt_open_turns += 1
        if self.introduced and not self.doubt_pending and self.steps_done < len(steps):
            ahead = any(s.guide.matches(text) for s in steps[self.steps_done + 1:])
            if ahead:  # a later step guided now: out of order, and two steps at once are never performed
                events.append("step_out_of_order")
            elif steps[self.steps_done].guide.matches(text):
                events.append("step_guided")
                seen["guided_next"] = True
        if not useful:
            events.append("no_progress")
        return events, seen

    def _repeats(self, text: str) -> bool:
        """Remember the agent turn `text`; True when it repeats an earlier one (see the module docstring)."""
        tokens, joined, digest = fingerprint(text)
        repeated = digest in self.turn_digests or similar_to_any(tokens, self.recent_turns)
        self.turn_digests = self.turn_digests | {digest}
        self.recent_turns = (*self.recent_turns, joined)[-REPETITION_WINDOW:]
        return repeated

    def footprint(self) -> int:
        """Approximate bytes held by this persona (what the backend's byte-bounded cache counts)."""
        return PERSONA_BASE_BYTES + sum(len(t) for t in self.recent_turns) + 100 * len(self.turn_digests)

    def _apply(self, events: list[str]) -> dict[str, int]:
        deltas = {dim: 0 for dim in self.scenario.dims}
        for event in events:
            for dim, delta in self.spec.effects.get(event, {}).items():
                deltas[dim] += delta
        for dim, delta in deltas.items():
            self.state[dim] = self.scenario.state_ranges[dim].clamp(self.state[dim] + delta)
        return deltas

    def _should_hang_up(self, deltas: dict[str, int]) -> bool:
        rules, schema = self.spec.rules, self.scenario.state_schema
        worse = any(schema.improvement(dim, deltas.get(dim, 0)) < 0
                    and schema.improvement(dim, self.state[dim] - at) <= 0 for dim, at in rules.hang_up_at.items())
        return worse or self.doubt_open_turns > rules.doubt_patience

    def react(self, agent_text: str) -> TurnOutcome:
        """Update the state with one agent turn (its spoken words) and decide the reply and status."""
        statuses = self.scenario.statuses
        if self.status != statuses.ongoing:
            return TurnOutcome((), "completed" if self.status == statuses.completed else "hang_up", self.status)
        events, seen = self._detect(agent_text)
        deltas = self._apply(events)
        outcome = self._decide(events, seen, deltas, len(self.spec.steps))
        self.status = outcome.status
        if outcome.line == "greeting" or outcome.prefix == "greeting":
            self.greeted = True
        return outcome

    def _decide(self, events: list[str], seen: dict[str, bool], deltas: dict[str, int], n_steps: int) -> TurnOutcome:
        ev, statuses = tuple(events), self.scenario.statuses
        if self._should_hang_up(deltas):
            return TurnOutcome(ev, "hang_up", statuses.ended)
        if seen["overloaded"]:
            return TurnOutcome(ev, "overloaded", statuses.ongoing)
        if self.steps_done_before_turn == n_steps and seen["confirmation"]:
            return TurnOutcome(ev, "completed", statuses.completed)
        if seen["goodbye"]:
            return TurnOutcome(ev, "hang_up", statuses.ended)
        if not self.introduced:
            return TurnOutcome(ev, "ask_who", statuses.ongoing)
        if self.doubt_pending:
            prefix = None if self.greeted else "greeting"
            self.doubt_voiced = True
            return TurnOutcome(ev, ("doubt", self.doubts[self.doubt_index].category), statuses.ongoing, prefix)
        if seen["guided_next"]:
            if not self.spec.rules.may_act(self.state):
                return TurnOutcome(ev, "reluctant", statuses.ongoing)
            self.steps_done += 1
            return TurnOutcome(ev, ("done", self.steps_done - 1), statuses.ongoing)
        if "step_out_of_order" in events:
            return TurnOutcome(ev, "confused", statuses.ongoing)
        if not self.greeted:
            return TurnOutcome(ev, "greeting", statuses.ongoing)
        return TurnOutcome(ev, "confused" if "no_progress" in events else "agree", statuses.ongoing)

    def copy(self) -> "ScriptedPersona":
        """An independent copy (the state dict is the only mutable part that changes)."""
        twin = copy.copy(self)
        twin.state = dict(self.state)
        return twin

    def resync(self, turn: UserTurn) -> None:
        """Adopt the state and a final status recorded in this persona's earlier reply (the record wins)."""
        dims = self.scenario.dims
        if all(isinstance(turn.state.get(d), int) for d in dims):
            self.state = {d: int(turn.state[d]) for d in dims}
        if turn.status in self.scenario.statuses.final:
            self.status = turn.status


def _prefix_keys(messages: list[dict[str, str]]) -> list[str]:
    """keys[i] = a hash of messages[: i + 1] (roles and contents, length-prefixed so no two prefixes collide)."""
    hasher, keys = hashlib.sha256(), []
    for message in messages:
        for part in (message["role"], message["content"]):
            data = part.encode()
            hasher.update(b"%d:" % len(data) + data)
        keys.append(hasher.copy().hexdigest())
    return keys


def count_words(text: str) -> int:
    """Whitespace-separated words of a spoken turn (the unit of `scripted.rules.max_words`)."""
    return len(text.split())


def count_tokens(text: str) -> int:
    """Approximate token count (words and punctuation marks) used for `usage` and `max_tokens`.

    Counted match by match (not one `findall` call) so a 1 MB message never holds the GIL in one go."""
    return sum(1 for _ in _TOKEN_RE.finditer(text))


class _CacheEntry(NamedTuple):
    """The persona after a request's messages, their prompt-token count, and the entry's estimated bytes."""

    persona: ScriptedPersona
    prompt_tokens: int
    size: int


class ScriptedPersonaBackend:
    """ChatBackend answering as the scenario's scripted persona (deterministic for persona + seed)."""

    def __init__(self, scenario: Scenario, seed: int = 0, cache_size: int = 4096,
                 cache_bytes: int = 64 << 20) -> None:
        self.scenario = scenario
        self.seed = seed
        self._cache: OrderedDict[str, _CacheEntry] = OrderedDict()
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        self._cached_bytes = 0
        self._cache_lock = threading.Lock()

    @property
    def cache_footprint(self) -> tuple[int, int]:
        """(entries, estimated bytes) held by the persona cache (bounded by cache_size and cache_bytes)."""
        with self._cache_lock:
            return len(self._cache), self._cached_bytes

    def _cached(self, key: str) -> tuple[ScriptedPersona, int] | None:
        """(a copy of the persona, the prompt tokens of the messages) cached under `key`, or None."""
        with self._cache_lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        return None if hit is None else (hit.persona.copy(), hit.prompt_tokens)

    def _remember(self, key: str, persona: ScriptedPersona, prompt_tokens: int) -> None:
        size = persona.footprint() + len(key)
        if size > self._cache_bytes:
            return
        with self._cache_lock:
            old = self._cache.pop(key, None)
            if old is not None:
                self._cached_bytes -= old.size
            self._cache[key] = _CacheEntry(persona.copy(), prompt_tokens, size)
            self._cached_bytes += size
            while len(self._cache) > self._cache_size or self._cached_bytes > self._cache_bytes:
                self._cached_bytes -= self._cache.popitem(last=False)[1].size

    @classmethod
    def from_scenario_file(cls, path: str | Path, seed: int = 0) -> "ScriptedPersonaBackend":
        """Load the scenario YAML at `path` (ScenarioError names the file and key of any problem)."""
        return cls(load_scenario(path), seed=seed)

    def replay(self, messages: list[dict[str, str]]) -> tuple[ScriptedPersona, TurnOutcome, int]:
        """Rebuild the persona from the full message list; returns it, its reaction to the last turn and the
        messages' token count (`count_tokens` summed over their contents).

        The persona after each request's last agent turn (and that request's token count) is kept in a bounded
        LRU cache keyed by a hash of the messages so far; the dialogue's next request (that prefix + this
        persona's reply + a new agent turn) starts from it and replays and counts only the two new messages. A
        miss replays and counts everything (same result).
        """
        if messages[0]["role"] != "system":
            raise BackendInputError("messages[0] must be the persona system message "
                                    "(Scenario.render_user_messages output)")
        try:
            profile = self.scenario.recover_profile(messages[0]["content"])
        except ValueError as err:
            raise BackendInputError(f"messages[0]: {err}") from err
        if len(messages) < 2 or messages[-1]["role"] != "user":
            raise BackendInputError("the last message must be the agent's turn (role 'user')")
        keys = _prefix_keys(messages)
        start, persona, prompt_tokens = 1, None, 0
        if len(messages) >= 4 and messages[-2]["role"] == "assistant" and messages[-3]["role"] == "user":
            hit = self._cached(keys[-3])
            if hit is not None:
                (persona, prompt_tokens), start = hit, len(messages) - 2
        if persona is None:
            persona, prompt_tokens = ScriptedPersona(self.scenario, profile), count_tokens(messages[0]["content"])
        outcome = TurnOutcome((), "agree", self.scenario.statuses.ongoing)
        for i in range(start, len(messages)):
            role, content = messages[i]["role"], messages[i]["content"]
            prompt_tokens += count_tokens(content)
            if role == "user":
                outcome = persona.react(content)
            elif role == "assistant":
                persona.resync(self.scenario.parse_user_output(content))
            else:
                raise BackendInputError(f"messages[{i}]: role {role!r} is not expected after the persona "
                                        "(only 'user' = agent turns and 'assistant' = the persona)")
        self._remember(keys[-1], persona, prompt_tokens)
        return persona, outcome, prompt_tokens

    def _line(self, key: str | tuple[str, object], rng: random.Random | None) -> str:
        spec = self.scenario.scripted
        if isinstance(key, tuple):
            kind, value = key
            options = spec.categories[value].doubt if kind == "doubt" else spec.steps[value].done
        else:
            options = spec.lines[key]
        return options[0] if rng is None else rng.choice(options)

    def render(self, persona: ScriptedPersona, outcome: TurnOutcome, rng: random.Random | None) -> str:
        """The reply text in the scenario's user tag protocol."""
        spoken = self._line(outcome.line, rng)
        if outcome.prefix is not None:
            spoken = f"{self._line(outcome.prefix, rng)} {spoken}"
        think = None
        if self.scenario.user_tags.tag("think") is not None:
            think = "Reacting to: " + (", ".join(outcome.events) or "nothing in particular") + "."
        return self.scenario.format_user_output(spoken, persona.state, outcome.status, think=think)

    def complete(self, messages: list[dict[str, str]], params: SamplingParams) -> BackendResult:
        """Answer the last agent turn `params.n` times (wording varies per choice unless temperature is 0)."""
        persona, outcome, prompt_tokens = self.replay(messages)
        digest = hashlib.sha256(messages[0]["content"].encode()).hexdigest()
        turn_index = sum(1 for m in messages if m["role"] == "user")
        choices = []
        for i in range(params.n):
            rng = None
            if params.temperature > 0:
                material = f"{digest}|{self.seed}|{params.seed}|{turn_index}|{i}".encode()
                rng = random.Random(int.from_bytes(hashlib.sha256(material).digest()[:8], "big"))
            choices.append(_truncate(self.render(persona, outcome, rng), params.max_tokens))
        return BackendResult(choices=choices, prompt_tokens=prompt_tokens)


def _truncate(text: str, max_tokens: int | None) -> Completion:
    tokens = list(_TOKEN_RE.finditer(text))
    if max_tokens is None or len(tokens) <= max_tokens:
        return Completion(text, "stop", len(tokens))
    return Completion(text[: tokens[max_tokens - 1].end()], "length", max_tokens)
