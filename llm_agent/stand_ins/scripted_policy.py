"""A scripted stand-in for the actor worker group: rule-based agent turns for the rollout loop's tests and benchmark.

`ScriptedPolicyWorkerGroup` is a `RolloutEngine` (policy version 0) whose `generate_sequences` returns exactly the
tensors of
`verl.workers.rollout.hf_rollout.HFRollout` (left-padded prompts in, responses right-padded to
`meta_info["response_length"]`, EOS-terminated, mask 1 up to and including the EOS), but the words come from a
:class:`ScriptedAgent` instead of a model. The agent is stateless: it decodes each row, splits the chat with the
tokenizer's chat template (`llm_agent.rollout.chat_layout.ChatLayout`) and replays the agent-side dialogue (its
own earlier turns and the user's spoken replies) to see where the call is. It writes only what :class:`SopLines` composes from the
scenario's `scripted` cue words, so it works for any scenario file and never reads the user's state tags.

Qualities: "good" follows the SOP (introduction with the identity question, one short answer per voiced
doubt, a pitch, one step per turn, then the confirmation question; an empathy opener every turn; never the
same words twice); "bad" is pushy and robotic and ignores doubts; "malformed" writes the good words without the
reply tag; "ender" writes a good first turn with status 1 (the agent ends the call); "evasive" is "good" but
answers only the doubts of the first third of the scenario's doubt categories (file order, at least one) and
talks past the others with the next part of the SOP, so a user with such a doubt repeats it and hangs up (a
warm-start ingredient: mixed with "good", the greedy policy completes only calls whose doubts it knows);
"wrong_answer" is "good" but answers every doubt with the answer of another category (the next one in file order
whose answer misses the asked one's cues): a turn shaped like an answer with the wrong content, which a user
simulator must not take for one (a simulator fine-tuning ingredient).
`instant=True` skips decoding altogether and returns a precomputed turn (constant time, for the loop benchmark).
"""
from __future__ import annotations

import difflib
import functools
import itertools
import logging
import random
import re
from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict

from llm_agent.rollout.chat_layout import ChatLayout
from llm_agent.scenario import CueList, Scenario
from verl.protocol import DataProto
from verl.workers.batching import select_batch
from verl.workers.rollout.engine import RolloutEngine
from verl.workers.rollout.hf_rollout import generation_tensors

logger = logging.getLogger(__name__)

__all__ = ["QUALITIES", "ScriptedAgent", "ScriptedPolicyWorkerGroup", "too_similar"]

QUALITIES = ("good", "bad", "malformed", "ender", "evasive", "wrong_answer")
PROMPT_KEYS = ("input_ids", "attention_mask", "position_ids")
SIMILARITY_LIMIT = 0.85  # below the scripted user's 0.9 repetition threshold, with a margin
_TOKEN_RE = re.compile(r"\w+|[^\w\s]")
_DANGLING = frozenset({"a", "an", "the", "about", "for", "to", "of", "with", "from", "your", "my", "is", "on", "in"})
_GUIDE_FRAMES = ("Next step: {}.", "Now, please {}.", "When you're ready, {}.")


def too_similar(a: str, b: str, limit: float = SIMILARITY_LIMIT) -> bool:
    """True when two spoken turns share at least `limit` of their lower-cased word/punctuation tokens."""
    ta, tb = _TOKEN_RE.findall(a.lower()), _TOKEN_RE.findall(b.lower())
    return difflib.SequenceMatcher(None, ta, tb, autojunk=False).ratio() >= limit


def _plain(cues: CueList) -> list[str]:
    """The plain-phrase entries of a cue list (regex entries cannot be spoken)."""
    return [c for c in cues.sources if not c.startswith("re:")]


def _spoken(text: str) -> str:
    """Sentence case with a capital first letter and a capital "I" (cues are lower-case phrases)."""
    text = re.sub(r"\bi\b", "I", text)
    return text[:1].upper() + text[1:]


class SopLines:
    """Short sentences composed from a scenario's `scripted` cue words, each checked against the cues.

    Every option of a task part must hit its own cue list and no pushy, robotic or goodbye cue, and may guide
    no step other than its own, so a turn made of them does exactly one thing. The framing words ("Next step:")
    are fixed; the content words are the scenario's own cue phrases.
    """

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        spec = self.spec = scenario.scripted
        cues, ids = spec.cues, scenario.stage_ids
        self._bad = [cues[key] for key in ("pushy", "robotic", "goodbye")]
        self._task_lists = [*spec.stage_cues.values(), *(s.guide for s in spec.steps),
                            *(c.resolve for c in spec.categories.values()), cues["confirmation"]]
        self.openers = self._keep([f"{_spoken(p)}." for p in _plain(cues["empathy"])
                                   if p.split()[-1] not in _DANGLING]) or [""]
        self.intros = self._intros()
        self.identity = self._keep([f"Quick check first: {p}?" for p in _plain(spec.stage_cues[ids[0]])],
                                   spec.stage_cues[ids[0]])
        self.pitch = self._keep([f"It's about this: {p}." for p in _plain(spec.stage_cues[ids[1]])],
                                spec.stage_cues[ids[1]]) if len(ids) > 1 else []
        self.answers = {category: self._keep([f"On that point: {p}." for p in _plain(script.resolve)], script.resolve)
                        for category, script in spec.categories.items()}
        self.guides = [self._keep([frame.format(p) for p in _plain(step.guide) for frame in _GUIDE_FRAMES],
                                  step.guide, step=i) for i, step in enumerate(spec.steps)]
        self.confirms = self._keep([f"Last check: {p}?" for p in _plain(cues["confirmation"])], cues["confirmation"])
        missing = [c for c, options in self.answers.items() if not options]
        if missing:
            logger.warning("scenario %s: no speakable answer for doubt categories %s", scenario.name, missing)
        for what, options in (("intro", self.intros), ("identity", self.identity), ("confirmation", self.confirms),
                              *((f"step {i} guide", g) for i, g in enumerate(self.guides))):
            if not options:
                raise ValueError(f"scenario {scenario.name}: the scripted cues give no usable {what} sentence "
                                 f"(file {scenario.path}, key scripted)")

    def _keep(self, candidates: Sequence[str], must: CueList | None = None, step: int | None = None) -> list[str]:
        """The distinct candidates that hit `must`, hit no bad cue and guide no step other than `step`."""
        kept = []
        for text in dict.fromkeys(_spoken(c) for c in candidates):
            if must is not None and not must.matches(text):
                continue
            if any(cue.matches(text) for cue in self._bad):
                continue
            if any(s.guide.matches(text) for i, s in enumerate(self.spec.steps) if i != step):
                continue
            kept.append(text)
        return kept

    def _intros(self) -> list[str]:
        """Greetings naming the caller and the organisation (the name from `vars.agent_name` when needed)."""
        cues = self.spec.cues
        name = self.scenario.vars.get("agent_name")
        options = []
        for phrase, org in itertools.product(_plain(cues["self_intro"]), _plain(cues["organisation"])):
            if phrase.split()[-1] in ("from", "of"):
                options.append(f"Hello, {phrase} {org}.")
            elif name and name.lower() in phrase.lower():
                options.append(f"Hello, {phrase} from {org}.")
            elif name:
                options.append(f"Hello, {phrase} {name} from {org}.")
        both = [_spoken(t) for t in options if cues["self_intro"].matches(t) and cues["organisation"].matches(t)]
        return self._keep(both)

    def wrong_answers(self, category: str) -> list[str]:
        """The answers of the first category after `category` (file order, wrapping) with options that miss
        `category`'s resolve cues: those options; [] when every other category's answers would resolve it."""
        categories = list(self.answers)
        start = categories.index(category)
        resolve = self.spec.categories[category].resolve
        for other in categories[start + 1:] + categories[:start]:
            options = [text for text in self.answers[other] if not resolve.matches(text)]
            if options:
                return options
        return []

    def topics(self, text: str) -> int:
        """How many task cue lists `text` hits (what the scripted user counts against `rules.max_topics`)."""
        return sum(1 for cues in self._task_lists if cues.matches(text))

    def fits(self, text: str) -> bool:
        """True when the turn stays under the user's `max_words` and `max_topics` limits."""
        rules = self.spec.rules
        return len(text.split()) < rules.max_words and self.topics(text) < rules.max_topics

    def is_pitch(self, text: str) -> bool:
        """True when `text` already did the second stage's content (the pitch)."""
        ids = self.scenario.stage_ids
        return len(ids) > 1 and self.spec.stage_cues[ids[1]].matches(text)

    def stage(self, position: int) -> int:
        """The stage id at SOP `position` (0 identity, 1 interest and doubts, 2 steps, 3 confirmation), clamped
        to the scenario's last stage."""
        ids = self.scenario.stage_ids
        return ids[min(position, len(ids) - 1)]

    def bad_turn(self, turn: int) -> list[list[str]]:
        """Parts of a pushy, robotic turn that skips to the last step and ignores whatever the user said."""
        cues = self.spec.cues
        robotic = [f"{_spoken(p)}." for p in _plain(cues["robotic"])] or [""]
        pushy = [f"{_spoken(p)}!" for p in _plain(cues["pushy"])] or [""]
        rush = self.guides[-1] or self.confirms
        return [robotic, self.intros, pushy, rush] if turn == 0 else [pushy, robotic, rush]

    def instant_turns(self) -> list[str]:
        """One fixed well-formed turn per stage (status 0, mid-range estimates) for the instant policy."""
        ranges = self.scenario.state_ranges
        mid = {d: (r.min + r.max) // 2 for d, r in ranges.items()}
        reply = f"{self.openers[0]} {self.intros[0]}".strip()
        ongoing = self.scenario.statuses.ongoing
        return [self.scenario.format_agent_output(reply, sid, ongoing, mid) for sid in self.scenario.stage_ids]


@functools.lru_cache(maxsize=16)
def sop_lines(scenario: Scenario) -> SopLines:
    """The scenario's `SopLines`, composed once per scenario object (agents only read them)."""
    return SopLines(scenario)


class ScriptedAgent:
    """Decides one agent turn from the agent-side dialogue so far (see the module docstring for qualities)."""

    def __init__(self, scenario: Scenario, quality: str = "good", seed: int = 0) -> None:
        if quality not in QUALITIES:
            raise ValueError(f"ScriptedAgent: quality must be one of {QUALITIES}, got {quality!r}")
        self.scenario = scenario
        self.quality = quality
        self.seed = seed
        self.lines = sop_lines(scenario)
        spec = scenario.scripted
        self._line_keys = ("ask_who", "reluctant", "overloaded", "confused", "completed", "hang_up", "greeting",
                           "agree")
        self._lines = {key: spec.lines.get(key, ()) for key in self._line_keys}
        categories = list(spec.categories)
        self.answered = frozenset(categories if quality != "evasive" else categories[:max(1, len(categories) // 3)])

    def classify(self, user_reply: str) -> tuple[str, Any]:
        """What a user reply is: ("doubt", category), ("done", step index), a `scripted.lines` key, or ("other",)."""
        spec = self.scenario.scripted
        for category, script in spec.categories.items():
            if any(line in user_reply for line in script.doubt):
                return "doubt", category
        for i, step in enumerate(spec.steps):
            if any(line in user_reply for line in step.done):
                return "done", i
        for key in self._line_keys:
            if any(line in user_reply for line in self._lines[key]):
                return key, None
        return "other", None

    def respond(self, history: Sequence[tuple[str, str]]) -> str:
        """The next agent turn in the scenario's agent tag protocol.

        `history` is the chat after the system prompt as (role, content): the opening (user), then alternating
        assistant turns (raw, as written) and user turns (spoken replies); the last entry is a user message.
        """
        agent_turns = [self.scenario.parse_agent_output(c) for r, c in history if r == "assistant"]
        said = [t.reply or "" for t in agent_turns]
        kinds = [self.classify(c) for i, (r, c) in enumerate(history) if r == "user" and i > 0]
        rng = random.Random(f"{self.seed}|{len(said)}|{history[-1][1] if history else ''}")
        steps_done = 0
        for kind, value in kinds:
            if kind == "done" and value == steps_done:
                steps_done += 1
        last = kinds[-1] if kinds else ("start", None)
        if self.quality == "bad":
            parts, position = self.lines.bad_turn(len(said)), 2
        else:
            parts, position = self._good_parts(last, steps_done, said)
        reply = self._fresh(parts, said, rng)
        stage = self.lines.stage(position)
        statuses = self.scenario.statuses
        status = statuses.completed if self.quality == "ender" and not said else statuses.ongoing
        estimate = self._estimate(kinds, steps_done)
        if self.quality == "malformed":
            return f"{self.scenario.format_agent_output(None, stage, status, estimate)}\n{reply}"
        return self.scenario.format_agent_output(reply, stage, status, estimate)

    def _good_parts(self, last: tuple[str, Any], steps_done: int, said: list[str]) -> tuple[list[list[str]], int]:
        """The sentence options of each part of a good turn, in order, and the turn's SOP position."""
        lines = self.lines
        pitched = any(lines.is_pitch(text) for text in said)
        kind, value = last
        if kind in ("start", "ask_who"):
            return [lines.intros, lines.identity], 0
        if kind == "doubt" and value not in self.answered:  # evasive: carry on as if nothing was asked
            kind = "other"
        if kind == "doubt":
            answer = (lines.wrong_answers(value) if self.quality == "wrong_answer" else lines.answers.get(value)) \
                or lines.pitch or lines.identity  # no speakable answer: move on
            return [lines.openers, *([] if pitched or not lines.pitch else [lines.pitch]), answer], 1
        if steps_done >= len(lines.guides):
            return [lines.openers, lines.confirms], 3
        if not pitched and steps_done == 0 and lines.pitch:
            return [lines.openers, lines.pitch], 1
        return [lines.openers, lines.guides[steps_done]], 2

    def _fresh(self, parts: list[list[str]], said: list[str], rng: random.Random) -> str:
        """The first combination of the parts' options (from random offsets) not too similar to an earlier turn."""
        rotated = []
        for options in parts:
            k = rng.randrange(len(options))
            rotated.append(options[k:] + options[:k])
        text = ""
        for combo in itertools.islice(itertools.product(*rotated), 256):
            text = " ".join(part for part in combo if part)
            if self.lines.fits(text) and not any(too_similar(text, earlier) for earlier in said):
                return text
        logger.debug("scripted agent: every combination repeats an earlier turn; saying %r again", text)
        return text

    def _estimate(self, kinds: list[tuple[str, Any]], steps_done: int) -> dict[str, int]:
        """A rough guess of the user's state from the replies, expecting the persona's own `scripted.effects`:
        mid-range, then `introduced`'s effect once introduced, `doubt_resolved`'s per doubt moved past,
        `stage_progress`'s per step done and `no_progress`'s per confused/reluctant reply."""
        ranges, effects = self.scenario.state_ranges, self.scenario.scripted.effects
        guess = {d: (r.min + r.max) // 2 for d, r in ranges.items()}
        doubts = [value for kind, value in kinds if kind == "doubt"]
        settled = len(set(doubts)) - (1 if kinds and kinds[-1][0] == "doubt" else 0)
        introduced = any(kind not in ("ask_who", "other") for kind, _ in kinds)
        upset = sum(kind in ("confused", "overloaded", "reluctant") for kind, _ in kinds)
        for event, times in (("introduced", int(introduced)), ("doubt_resolved", settled),
                             ("stage_progress", steps_done), ("no_progress", upset)):
            for dim, delta in effects[event].items():
                guess[dim] += delta * times
        return {d: ranges[d].clamp(v) for d, v in guess.items()}


class ScriptedPolicyWorkerGroup(RolloutEngine):
    """Worker-group stand-in whose `generate_sequences` has HFRollout's contract but scripted words.

    `calls` records, per call, each row's returned response tokens (up to and including the EOS when there is
    one), so tests can compare them with what the rollout loop kept. With `instant=True`, `instant_turn_ids`
    holds the precomputed turns' token ids (without EOS), one per stage; a row gets the turn of stage
    `(EOS tokens in the row // 2) % n_stages`, so the stage moves on by one per finished agent + user turn.
    """

    def __init__(self, tokenizer: Any, scenario: Scenario, world_size: int = 2, quality: str = "good",
                 seed: int = 0, instant: bool = False, response_length: int | None = None) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"ScriptedPolicyWorkerGroup: world_size must be an int >= 1, got {world_size!r}")
        self.tokenizer = tokenizer
        self.scenario = scenario
        self.world_size = world_size
        self.instant = instant
        self.response_length = response_length
        self.agent = ScriptedAgent(scenario, quality=quality, seed=seed)
        self.layout = None if instant else ChatLayout(tokenizer)
        self.calls: list[list[list[int]]] = []
        self.instant_turn_ids = [tokenizer.encode(text, add_special_tokens=False)
                                 for text in self.agent.lines.instant_turns()] if instant else []

    def _settings(self, meta_info: dict[str, Any]) -> tuple[list[int], int, int]:
        """(eos ids, pad id, response length) from meta_info, falling back to the tokenizer / constructor."""
        eos = meta_info.get("eos_token_id", self.tokenizer.eos_token_id)
        pad = meta_info.get("pad_token_id", self.tokenizer.pad_token_id)
        pad = eos if pad is None and isinstance(eos, int) else pad
        length = meta_info.get("response_length", self.response_length)
        if eos is None or pad is None:
            raise ValueError("generate_sequences: meta_info needs eos_token_id and pad_token_id")
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"generate_sequences: meta_info['response_length'] must be an int >= 1, got {length!r}")
        eos_ids = [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]
        return eos_ids, int(pad), length

    def _texts(self, input_ids: torch.Tensor, mask: torch.Tensor, eos_ids: list[int]) -> list[list[int]]:
        """Each row's response tokens without EOS: instant turns by EOS count, else the agent's decoded decision."""
        if self.instant:
            counts = (torch.isin(input_ids, torch.tensor(eos_ids)) & mask.bool()).sum(dim=1).tolist()
            return [self.instant_turn_ids[(n // 2) % len(self.instant_turn_ids)] for n in counts]
        rows = []
        for i in range(input_ids.size(0)):
            ids = input_ids[i][mask[i].bool()].tolist()
            text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            try:
                history = self.layout.split(text)
            except ValueError as exc:
                raise ValueError(f"generate_sequences: row {i}: {exc}") from None
            rows.append(self.tokenizer.encode(self.agent.respond(history), add_special_tokens=False))
        return rows

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """One scripted response per left-padded prompt row, with HFRollout's output keys and shapes."""
        batch = select_batch(prompts, PROMPT_KEYS, "generate_sequences")
        rows = batch.batch_size[0]
        if rows == 0 or rows % self.world_size:
            raise ValueError(f"generate_sequences: {rows} rows are not divisible by world_size={self.world_size} "
                             "(or the batch is empty)")
        mask = batch["attention_mask"]
        right_padded = (mask[:, -1] == 0).nonzero().flatten().tolist()
        if right_padded:
            raise ValueError(f"generate_sequences: prompts must be left-padded, but rows {right_padded[:8]} end "
                             "with padding")
        eos_ids, pad, length = self._settings(prompts.meta_info)
        input_ids = batch["input_ids"]
        sampled = [(ids + [eos_ids[0]])[:length] for ids in self._texts(input_ids, mask, eos_ids)]
        responses = torch.tensor([ids + [pad] * (length - len(ids)) for ids in sampled], dtype=input_ids.dtype)
        tensors = generation_tensors(input_ids, mask, batch["position_ids"], responses, eos_ids, pad)
        kept = tensors["response_mask"].sum(dim=1).tolist()
        self.calls.append([ids[:n] for ids, n in zip(sampled, kept)])
        return self.versioned(DataProto(batch=TensorDict(tensors, batch_size=[rows])))

