"""Scenarios: load a `format_prompt/<name>.yaml`, render both sides' prompts and parse both sides' tags.

`load_scenario(path)` validates the file (`docs/scenario_schema.md`) and returns a frozen `Scenario`. The
rollout loop uses `render_agent_prompt`, `parse_agent_output` and `render_user_messages`; the user-simulator
client parses replies with `parse_user_output`; the scripted simulator reads `Scenario.scripted`,
`recover_profile` and writes its replies with `format_user_output`.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llm_agent.scenario.diagnosis_spec import DiagnosisRule
from llm_agent.scenario.loading import load_behavior_library, read_scenario_fields
from llm_agent.scenario.tags import (CueList, TagScan, bullets, format_tags, parse_int, strip_tags,
                                      substitute)
from llm_agent.scenario.types import (CUE_KEYS, EVENTS, LINE_KEYS, AgentTurn, Behavior, CategoryScript, Dimension,
                                      ScenarioError, ScriptedRules, ScriptedSpec, ScriptedStep, Stage, StateRange,
                                      StateSchema, Statuses, TagProtocol, Turn, UserProfile, UserTurn)

logger = logging.getLogger(__name__)

__all__ = [
    "CUE_KEYS", "EVENTS", "LINE_KEYS", "AgentTurn", "Behavior", "CategoryScript", "CueList", "Dimension", "Scenario",
    "ScenarioError", "ScriptedRules", "ScriptedSpec", "ScriptedStep", "Stage", "StateRange", "StateSchema",
    "Statuses", "TagProtocol", "Turn", "UserProfile", "UserTurn", "load_behavior_library", "load_scenario",
    "sample_behaviors",
]

_LOADED: dict[tuple[str, str], "Scenario"] = {}  # (resolved path, sha256 of the bytes) -> the scenario
_LOADED_LIMIT = 32


def load_scenario(path: str | os.PathLike) -> "Scenario":
    """Load and validate a scenario YAML; ScenarioError names the file and key path of any problem.

    A file is parsed once per process and content: the training and validation loops, the reward and the
    metrics of one run share one `Scenario` (a file edited since is read anew)."""
    try:
        key = (os.path.realpath(path), hashlib.sha256(Path(path).read_bytes()).hexdigest())
    except OSError:
        key = None  # the loader names the problem
    if key is not None and key in _LOADED:
        return _LOADED[key]
    scenario = Scenario(**read_scenario_fields(path))
    logger.info("loaded scenario %r from %s (%d stages, %d behaviours)", scenario.name, path,
                len(scenario.stages), len(scenario.behaviors))
    if key is not None:
        if len(_LOADED) >= _LOADED_LIMIT:
            _LOADED.pop(next(iter(_LOADED)))
        _LOADED[key] = scenario
    return scenario


def sample_behaviors(library: Sequence[Behavior], rng: random.Random, min_count: int = 1,
                     max_count: int = 3) -> list[Behavior]:
    """Draw a uniform count in [min_count, max_count] of distinct behaviours from `library` (seeded by `rng`)."""
    if not 0 <= min_count <= max_count:
        raise ValueError(f"need 0 <= min_count <= max_count, got {min_count}, {max_count}")
    count = min(rng.randint(min_count, max_count), len(library))
    return rng.sample(list(library), count)


@dataclass(frozen=True, eq=False)
class Scenario:
    """A validated scenario: prompts, stages, facts, tag protocols, behaviours, scripted-simulator data and the
    failure-diagnosis rules (empty when the file has no `diagnosis` section)."""

    name: str
    description: str
    path: str
    vars: dict[str, str]
    state_schema: StateSchema
    stages: tuple[Stage, ...]
    facts: tuple[str, ...]
    behaviors: tuple[Behavior, ...]
    scripted: ScriptedSpec
    agent_template: str
    agent_opening: str
    agent_tags: TagProtocol
    agent_compact_prompt: str
    """A one- or two-sentence system prompt for small models (`agent.compact_prompt`, default the description
    and "Answer in the tags."): what the CPU demo's tiny agent is told."""
    user_template: str
    user_tags: TagProtocol
    no_behaviors: str
    silent_agent: str
    diagnosis: tuple[DiagnosisRule, ...] = ()

    @property
    def stage_ids(self) -> tuple[int, ...]:
        """The stage ids in SOP order."""
        return tuple(s.id for s in self.stages)

    @property
    def dims(self) -> tuple[str, ...]:
        """The user-state dimension names, in file order."""
        return self.state_schema.names

    @property
    def state_ranges(self) -> dict[str, StateRange]:
        """{dimension: its range}."""
        return self.state_schema.ranges

    @property
    def statuses(self) -> Statuses:
        """The status tag's values."""
        return self.state_schema.statuses

    def state_space(self) -> list[tuple[int, ...]]:
        """Every combination of state values inside the ranges (values in dimension order)."""
        return self.state_schema.space()

    def state_key(self, state: Mapping[str, int] | Sequence[int]) -> str:
        """The state key of a state, e.g. "c2-e1-t3"."""
        return self.state_schema.key(state)

    def profile(self, values: Sequence[int], behaviors: Sequence[Behavior] = ()) -> UserProfile:
        """The profile of state `values` (in dimension order) and `behaviors`."""
        return UserProfile(self.state_schema.state(values), tuple(behaviors))

    def check_profile(self, profile: UserProfile) -> None:
        """Raise ValueError naming the dimension when the profile's initial state does not hold exactly this
        scenario's dimensions, each in its range."""
        try:
            self.state_schema.check(profile.state)
        except ValueError as exc:
            raise ValueError(f"{exc} (scenario {self.name})") from None

    # ----------------------------------------------------------------- rendering
    def _output_format(self, protocol: TagProtocol) -> str:
        lines, notes = [], []
        ranges = self.state_ranges
        statuses = sorted(self.statuses.values)
        for role, tag in protocol.tags.items():
            if role in ranges:
                rng = ranges[role]
                value, kind = f"{rng.min}-{rng.max}", f"an integer from {rng.min} to {rng.max}; "
            elif role == "stage":
                value, kind = "|".join(map(str, self.stage_ids)), "one of the stage ids; "
            elif role == "status":
                value = "|".join(map(str, statuses))
                kind = f"{', '.join(map(str, statuses[:-1]))} or {statuses[-1]}; "
            else:
                value, kind = "...", ""
            lines.append(f"<{tag}>{value}</{tag}>")
            notes.append(f"- <{tag}>: {kind}{protocol.abouts[role]}")
        return "\n".join(lines) + "\n\n" + "\n".join(notes)

    def render_agent_prompt(self) -> str:
        """The agent's system prompt with the stages, facts and output format filled in."""
        stages = bullets(f"Stage {s.id} ({s.name}): {s.goal}" for s in self.stages)
        return substitute(self.agent_template, {"stages": stages, "facts": bullets(self.facts),
                                                "output_format": self._output_format(self.agent_tags)})

    def render_user_prompt(self, profile: UserProfile) -> str:
        """The simulator's persona for `profile` (initial state and behaviours as `- ` bullet lines)."""
        self.check_profile(profile)
        behaviors = bullets(b.behavior for b in profile.behaviors) if profile.behaviors else self.no_behaviors
        values = {**{d: str(v) for d, v in profile.state.items()}, "behaviors": behaviors,
                  "output_format": self._output_format(self.user_tags)}
        return substitute(self.user_template, values)

    def spoken_agent_reply(self, turn: AgentTurn) -> str:
        """What the user hears of an agent turn: its reply without any protocol tag, or `silent_agent`."""
        if not turn.reply:
            return self.silent_agent
        text, _ = strip_tags(turn.reply, [*self.agent_tags.tags.values(), *self.user_tags.tags.values()])
        return text.strip() or self.silent_agent

    def render_user_messages(self, profile: UserProfile, dialogue: Sequence[Turn]) -> list[dict[str, str]]:
        """OpenAI chat messages for the simulator's next turn (see docs/scenario_schema.md section 4).

        System = persona; agent turns -> `user` messages holding only the spoken reply; the user's own turns
        -> `assistant` messages re-written canonically with their state tags and status. The dialogue must be
        non-empty and end with an agent turn.
        """
        if not dialogue or not isinstance(dialogue[-1], AgentTurn):
            raise ValueError("render_user_messages needs a dialogue that ends with an agent turn")
        messages = [{"role": "system", "content": self.render_user_prompt(profile)}]
        for i, turn in enumerate(dialogue):
            if isinstance(turn, AgentTurn):
                messages.append({"role": "user", "content": self.spoken_agent_reply(turn)})
            elif isinstance(turn, UserTurn):
                messages.append({"role": "assistant",
                                 "content": self.format_user_output(turn.reply or "", turn.state, turn.status)})
            else:
                raise TypeError(f"dialogue[{i}] is a {type(turn).__name__}, not an AgentTurn or UserTurn")
        return messages

    def render_agent_messages(self, dialogue: Sequence[Turn]) -> list[dict[str, str]]:
        """OpenAI chat messages from the agent's side: system prompt, the opening, then the turns so far.

        Agent turns are kept verbatim (`raw`, what the policy wrote); user turns carry only the spoken reply.
        """
        messages = [{"role": "system", "content": self.render_agent_prompt()},
                    {"role": "user", "content": self.agent_opening}]
        for i, turn in enumerate(dialogue):
            if isinstance(turn, AgentTurn):
                messages.append({"role": "assistant", "content": turn.raw})
            elif isinstance(turn, UserTurn):
                messages.append({"role": "user", "content": (turn.reply or "").strip() or "..."})
            else:
                raise TypeError(f"dialogue[{i}] is a {type(turn).__name__}, not an AgentTurn or UserTurn")
        return messages

    # ------------------------------------------------------------------- parsing
    def _parse(self, text: Any, protocol: TagProtocol) -> tuple[dict[str, Any], list[str], bool]:
        if not isinstance(text, str):
            return {"state": {d: None for d in self.dims}}, [f"invalid:input({type(text).__name__})"], True
        all_tags = [*self.agent_tags.tags.values(), *self.user_tags.tags.values()]
        fields: dict[str, Any] = {}
        state: dict[str, int | None] = {d: None for d in self.dims}
        flags: list[str] = []
        out_of_range = False
        scan = TagScan(text)
        for role, tag in protocol.tags.items():
            content, tag_flags = scan.extract(tag, all_tags)
            flags += [f"{f}:{role}" for f in tag_flags if not (role == "think" and f == "missing")]
            if content is None:
                continue
            if role in ("reply", "think"):
                fields[role] = content.strip()
                continue
            value = parse_int(content)
            if value is None:
                flags.append(f"invalid:{role}")
                continue
            if role in ("stage", "status") and not self._allowed(role, value):
                flags.append(f"out_of_range:{role}")
                out_of_range = True
                continue
            clamped = self.state_ranges[role].clamp(value) if role in state else value
            if clamped != value:
                flags.append(f"clamped:{role}")
            if role in state:
                state[role] = clamped
            else:
                fields[role] = clamped
        reply = fields.get("reply")
        if reply is not None:
            reply, had_tags = strip_tags(reply, all_tags)
            fields["reply"] = reply.strip()
            if had_tags:
                flags.append("tags_in_reply")
            if not fields["reply"]:
                flags.append("empty:reply")
        fields["state"] = state
        return fields, flags, out_of_range or not fields.get("reply")

    def _allowed(self, role: str, value: int) -> bool:
        """True when `value` is one of the protocol's values for the discrete tag `role` (stage or status)."""
        return value in (self.statuses.values if role == "status" else self.stage_ids)

    def parse_agent_output(self, text: str) -> AgentTurn:
        """Parse a policy output into an AgentTurn; never raises (problems become flags / parse_error)."""
        fields, flags, parse_error = self._parse(text, self.agent_tags)
        return AgentTurn(raw=text if isinstance(text, str) else repr(text), flags=tuple(flags),
                         parse_error=parse_error, **{"reply": None, **fields})

    def parse_user_output(self, text: str) -> UserTurn:
        """Parse a simulator output into a UserTurn; never raises (problems become flags / parse_error)."""
        fields, flags, parse_error = self._parse(text, self.user_tags)
        return UserTurn(raw=text if isinstance(text, str) else repr(text), flags=tuple(flags),
                        parse_error=parse_error, **{"reply": None, **fields})

    # ---------------------------------------------------------------- formatting
    def format_user_output(self, reply: str, state: Mapping[str, int | None], status: int | None,
                           think: str | None = None) -> str:
        """Write a user turn in the user tag protocol (None values and an absent think tag are omitted)."""
        values = {"reply": reply, "status": status, "think": think, **{d: state.get(d) for d in self.dims}}
        return format_tags((tag, values.get(role)) for role, tag in self.user_tags.tags.items())

    def format_agent_output(self, reply: str, stage: int | None, status: int | None,
                            state: Mapping[str, int | None], think: str | None = None) -> str:
        """Write an agent turn in the agent tag protocol, in the prompt's tag order (None values omitted)."""
        values = {"reply": reply, "stage": stage, "status": status, "think": think,
                  **{d: state.get(d) for d in self.dims}}
        return format_tags((tag, values.get(role)) for role, tag in self.agent_tags.tags.items())

    def recover_profile(self, persona: str) -> UserProfile:
        """Read the profile back out of a persona rendered by `render_user_prompt` (for the scripted simulator).

        Behaviours are matched to the scenario's library by text; a text not in the library gets the category
        "unknown". Raises ValueError when `persona` was not rendered from this scenario's template.
        """
        pattern = _template_regex(self.user_template, self._output_format(self.user_tags), self.dims)
        m = pattern.fullmatch(persona.strip())
        if m is None:
            raise ValueError(f"the system message is not a persona of scenario {self.name!r}")
        by_text = {b.behavior: b for b in self.behaviors}
        block = m.group("behaviors")
        texts = [] if block.strip() == self.no_behaviors.strip() else [
            line.strip()[2:].strip() for line in block.splitlines() if line.strip().startswith("- ")]
        behaviors = tuple(by_text.get(t, Behavior("unknown", t)) for t in texts)
        return self.profile([int(m.group(d)) for d in self.dims], behaviors)


@functools.lru_cache(maxsize=32)
def _template_regex(template: str, output_format: str, dims: tuple[str, ...]) -> re.Pattern:
    """Turn the user template into a regex with named groups for the profile placeholders."""
    groups = {d: rf"(?P<{d}>[+-]?\d+)" for d in dims}
    groups["behaviors"] = r"(?P<behaviors>.*?)"
    groups["output_format"] = re.escape(output_format)
    parts, pos, seen = [], 0, set()
    template = template.strip()
    for m in re.finditer(r"\$(?:\$|\{([A-Za-z_][A-Za-z0-9_]*)\})", template):
        parts.append(re.escape(template[pos:m.start()]))
        name = m.group(1)
        if name is None:
            parts.append(re.escape("$"))
        elif name in seen and name != "output_format":
            parts.append(f"(?P={name})")
        else:
            parts.append(groups[name])
            seen.add(name)
        pos = m.end()
    parts.append(re.escape(template[pos:]))
    return re.compile("".join(parts), re.DOTALL)
