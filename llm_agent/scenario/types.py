"""Value types of scenarios: errors, behaviours, profiles, parsed turns and the scripted-simulator data.

All are frozen dataclasses re-exported by `llm_agent.scenario`, which is the module to import from.
"""
from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

from llm_agent.scenario.tags import CueList

STATUS_ROLES: tuple[str, ...] = ("completed", "continue", "ended")  # a `statuses:` entry per role
BETTER: tuple[str, ...] = ("higher", "lower")  # which way a state dimension improves


class ScenarioError(ValueError):
    """A scenario or behaviour-library file is invalid; names the file and where (key path or line)."""

    def __init__(self, file: str, where: str, reason: str) -> None:
        super().__init__(f"{file}: {where}: {reason}" if where else f"{file}: {reason}")
        self.file, self.where, self.reason = file, where, reason


@dataclass(frozen=True)
class Behavior:
    """One sampled user behaviour: a category id (snake_case) and a sentence describing what the user does."""

    category: str
    behavior: str

    def __post_init__(self) -> None:
        # One line per behaviour: the persona renders each as a bullet and recover_profile reads them back.
        if not isinstance(self.category, str) or not isinstance(self.behavior, str):
            raise ValueError(f"Behavior fields must be strings, got {self.category!r}, {self.behavior!r}")
        object.__setattr__(self, "category", self.category.strip())
        object.__setattr__(self, "behavior", " ".join(self.behavior.split()))

    def to_dict(self) -> dict[str, str]:
        """JSON-ready form: {"category", "behavior"}."""
        return {"category": self.category, "behavior": self.behavior}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Behavior":
        """Inverse of to_dict; ValueError naming the key when a field is missing, not a string or empty."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a behaviour must be an object, got {type(d).__name__}")
        extra = set(d) - {"category", "behavior"}
        if extra:
            raise ValueError(f"unknown behaviour key(s) {sorted(extra)}")
        for key in ("category", "behavior"):
            if not isinstance(d.get(key), str) or not d[key].strip():
                raise ValueError(f"behaviour key {key!r} must be a non-empty string")
        return cls(d["category"].strip(), d["behavior"].strip())


@dataclass(frozen=True)
class StateRange:
    """An inclusive integer range of one state dimension."""

    min: int
    max: int

    def contains(self, value: int) -> bool:
        """True when min <= value <= max."""
        return self.min <= value <= self.max

    def clamp(self, value: int) -> int:
        """The nearest value inside the range."""
        return max(self.min, min(self.max, value))


@dataclass(frozen=True)
class Stage:
    """One SOP stage of the agent: its id (the value of the stage tag), a short name and its goal."""

    id: int
    name: str
    goal: str


@dataclass(frozen=True)
class Dimension:
    """One dimension of the user's state: its name (a tag role and a persona placeholder), its inclusive range, its
    `short` name (the state key's prefix, e.g. "c" in "c2-e1-t3", and the improvement metric's, "ci") and which
    way it gets `better` (higher, or lower: frustration)."""

    name: str
    range: StateRange
    short: str
    better: str = "higher"

    @property
    def sign(self) -> int:
        """+1 when higher values are better, -1 when lower ones are."""
        return 1 if self.better == "higher" else -1

    @property
    def span(self) -> int:
        """max - min."""
        return self.range.max - self.range.min


@dataclass(frozen=True)
class Statuses:
    """The values of the status tag: the task done (`completed`), the call going on (`ongoing`, the YAML's
    `continue`) and the call ended without it (`ended`)."""

    completed: int = 1
    ongoing: int = 0
    ended: int = -1

    @property
    def values(self) -> tuple[int, ...]:
        """Every allowed status value (ended, ongoing, completed)."""
        return (self.ended, self.ongoing, self.completed)

    @property
    def final(self) -> tuple[int, ...]:
        """The values that end a call (completed, ended)."""
        return (self.completed, self.ended)


State = dict[str, int]


@dataclass(frozen=True)
class StateSchema:
    """The user-state schema of a scenario (its `state:` and `statuses:` sections): the dimensions in file order
    and the status values. Every component that reads a user state (controller, cache, metrics, diagnosis, report)
    takes the dimensions from here."""

    dimensions: tuple[Dimension, ...]
    statuses: Statuses = Statuses()

    @property
    def names(self) -> tuple[str, ...]:
        """The dimension names, in file order."""
        return tuple(d.name for d in self.dimensions)

    def __getitem__(self, name: str) -> Dimension:
        for dim in self.dimensions:
            if dim.name == name:
                return dim
        raise KeyError(f"no state dimension {name!r} (dimensions: {list(self.names)})")

    @property
    def ranges(self) -> dict[str, StateRange]:
        """{dimension: its range}."""
        return {d.name: d.range for d in self.dimensions}

    @property
    def spans(self) -> dict[str, int]:
        """{dimension: max - min} (every span is positive: the loader refuses min >= max)."""
        return {d.name: d.span for d in self.dimensions}

    def key(self, values: Mapping[str, int] | Sequence[int]) -> str:
        """The state key of a state ({dimension: value} or values in dimension order), e.g. "c2-e1-t3"."""
        if isinstance(values, Mapping):
            values = [values[d.name] for d in self.dimensions]
        return "-".join(f"{d.short}{int(v)}" for d, v in zip(self.dimensions, values, strict=True))

    def parse_key(self, key: str) -> tuple[int, ...]:
        """The values (in dimension order) of a state key written by `key`; ValueError otherwise."""
        pattern = "-".join(f"{re.escape(d.short)}([+-]?\\d+)" for d in self.dimensions)
        m = re.fullmatch(pattern, key) if isinstance(key, str) else None
        if m is None:
            example = self.key([d.range.min for d in self.dimensions])
            raise ValueError(f"bad state_key {key!r}: expected one '<short><int>' per dimension, e.g. {example!r}")
        return tuple(int(g) for g in m.groups())

    def space(self) -> list[tuple[int, ...]]:
        """Every combination of values inside the ranges, in dimension order."""
        return list(itertools.product(*(range(d.range.min, d.range.max + 1) for d in self.dimensions)))

    def state(self, values: Sequence[int]) -> State:
        """{dimension: value} of values given in dimension order."""
        return dict(zip(self.names, (int(v) for v in values), strict=True))

    def check(self, state: Mapping[str, Any], what: str = "profile") -> None:
        """ValueError naming the dimension unless `state` holds exactly the dimensions, each an int in range."""
        missing = [d for d in self.names if d not in state]
        extra = sorted(str(k) for k in state if k not in self.names)
        if missing or extra:
            raise ValueError(f"{what} must hold exactly the state dimensions {list(self.names)}"
                             + (f"; missing {missing}" if missing else "") + (f"; unknown {extra}" if extra else ""))
        for dim in self.dimensions:
            value = state[dim.name]
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{what} {dim.name} must be an int, got {value!r}")
            if not dim.range.contains(value):
                raise ValueError(f"{what} {dim.name}={value} is outside [{dim.range.min}, {dim.range.max}]")

    def improvement(self, name: str, delta: float) -> float:
        """`delta` of dimension `name` signed so that positive is better for the user."""
        return self[name].sign * delta

    def goodness(self, state: Mapping[str, Any]) -> float | None:
        """The mean over the dimensions present (int values) of how good the value is in its range, 0 (worst) to
        1 (best); None when no dimension is present."""
        parts = []
        for d in self.dimensions:
            value = state.get(d.name) if isinstance(state, Mapping) else None
            if isinstance(value, int) and not isinstance(value, bool):
                level = (value - d.range.min) / d.span
                parts.append(level if d.sign > 0 else 1.0 - level)
        return sum(parts) / len(parts) if parts else None

    def metric_keys(self) -> tuple[str, ...]:
        """The improvement metric of each dimension (its short name + "i": ei, ti, ci for the shipped scenarios)."""
        return tuple(f"{d.short}i" for d in self.dimensions)


@dataclass(frozen=True)
class UserProfile:
    """A simulated user: the initial state ({dimension: value}, the scenario's dimensions) and the sampled
    behaviours."""

    state: State
    behaviors: tuple[Behavior, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.state, Mapping):
            raise ValueError(f"a profile's state must be a mapping dimension -> int, got {self.state!r}")
        for dim, value in self.state.items():
            if not isinstance(dim, str) or isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"profile {dim} must be an int, got {value!r}")
        object.__setattr__(self, "state", dict(self.state))
        object.__setattr__(self, "behaviors", tuple(self.behaviors))
        for b in self.behaviors:
            if not isinstance(b, Behavior):
                raise ValueError(f"profile behaviors must be Behavior objects, got {type(b).__name__}")

    def __hash__(self) -> int:
        return hash((tuple(self.state.items()), self.behaviors))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: the state's dimensions plus "behaviors" as a list of {"category", "behavior"}."""
        return {**self.state, "behaviors": [b.to_dict() for b in self.behaviors]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "UserProfile":
        """Inverse of to_dict (every key but "behaviors" is a dimension; `Scenario.check_profile` checks them);
        ValueError naming the key on a mistyped field."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a profile must be an object, got {type(d).__name__}")
        raw = d.get("behaviors", [])
        if not isinstance(raw, (list, tuple)):
            raise ValueError("profile 'behaviors' must be a list")
        behaviors = []
        for i, b in enumerate(raw):
            try:
                behaviors.append(Behavior.from_dict(b))
            except ValueError as exc:
                raise ValueError(f"profile behaviors[{i}]: {exc}") from None
        return cls({k: v for k, v in d.items() if k != "behaviors"}, tuple(behaviors))


@dataclass(frozen=True)
class ParsedTurn:
    """What agent and user turns share: the raw text, the spoken reply, the status, the state (the user's own or
    the agent's estimates, {dimension: value or None}), the think text, the parse's flags and whether the reply
    could not be read."""

    raw: str
    reply: str | None
    status: int | None = None
    state: dict[str, int | None] = field(default_factory=dict)
    think: str | None = None
    flags: tuple[str, ...] = ()
    parse_error: bool = False

    @property
    def well_formed(self) -> bool:
        """True when every tag was present, single, closed and in range."""
        return not self.flags and not self.parse_error


@dataclass(frozen=True)
class AgentTurn(ParsedTurn):
    """A parsed policy output: spoken reply, stage, status and the agent's estimates of the user's state."""

    stage: int | None = None


@dataclass(frozen=True)
class UserTurn(ParsedTurn):
    """A parsed simulator output: spoken reply, the user's own state and its status."""


Turn = Union[AgentTurn, UserTurn]


@dataclass(frozen=True)
class TagProtocol:
    """One side's tags: role ("reply", "status", a state dimension, "stage", "think") -> tag name, in prompt order."""

    tags: dict[str, str]
    abouts: dict[str, str]

    def tag(self, role: str) -> str | None:
        """The tag name of `role`, or None when this side does not use it."""
        return self.tags.get(role)


@dataclass(frozen=True)
class ScriptedStep:
    """A required step of the task: the cues that show the agent guiding it and the user's lines once done."""

    id: str
    name: str
    guide: CueList
    done: tuple[str, ...]


@dataclass(frozen=True)
class CategoryScript:
    """How a doubt of one behaviour category plays out: the user's lines raising it and the cues that settle it."""

    doubt: tuple[str, ...]
    resolve: CueList


@dataclass(frozen=True)
class ScriptedRules:
    """Thresholds of the scripted simulator (see docs/scenario_schema.md section 5)."""

    hang_up_at: dict[str, int]
    doubt_patience: int
    max_words: int = 60
    max_topics: int = 8
    act_min: dict[str, int] = field(default_factory=dict)  # `act_min_<dimension>`: acts only at or above
    act_max: dict[str, int] = field(default_factory=dict)  # `act_max_<dimension>`: acts only at or below

    def may_act(self, state: Mapping[str, int]) -> bool:
        """True when `state` passes every `act_min_*` / `act_max_*` gate (a step is performed only then)."""
        return all(state[d] >= v for d, v in self.act_min.items()) and \
            all(state[d] <= v for d, v in self.act_max.items())


CUE_KEYS: tuple[str, ...] = ("self_intro", "organisation", "confirmation", "empathy", "pushy", "robotic", "goodbye")
LINE_KEYS: tuple[str, ...] = ("greeting", "ask_who", "confused", "agree", "reluctant", "completed", "hang_up")
OPTIONAL_LINE_KEYS: tuple[str, ...] = ("overloaded",)  # absent -> the `confused` lines
EVENTS: tuple[str, ...] = ("introduced", "stage_progress", "empathy", "pushy", "robotic", "repetition", "doubt_resolved",
                           "doubt_ignored", "step_guided", "step_out_of_order", "no_progress", "overloaded")


@dataclass(frozen=True)
class ScriptedSpec:
    """The data that drives the deterministic scripted simulator for one scenario."""

    cues: dict[str, CueList]
    stage_cues: dict[int, CueList]
    steps: tuple[ScriptedStep, ...]
    categories: dict[str, CategoryScript]
    lines: dict[str, tuple[str, ...]]
    effects: dict[str, dict[str, int]]
    rules: ScriptedRules
