"""Value types of scenarios: errors, behaviours, profiles, parsed turns and the scripted-simulator data.

All are frozen dataclasses re-exported by `llm_agent.scenario`, which is the module to import from.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

from llm_agent.scenario.tags import CueList

STATE_DIMS: tuple[str, ...] = ("cooperation", "emotion", "trust")
STATUS_COMPLETED, STATUS_CONTINUE, STATUS_ENDED = 1, 0, -1
STATUS_VALUES: tuple[int, ...] = (STATUS_ENDED, STATUS_CONTINUE, STATUS_COMPLETED)


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
class UserProfile:
    """A simulated user: the initial state (cooperation, emotion, trust) and the sampled behaviours."""

    cooperation: int
    emotion: int
    trust: int
    behaviors: tuple[Behavior, ...] = ()

    def __post_init__(self) -> None:
        for dim in STATE_DIMS:
            value = getattr(self, dim)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"profile {dim} must be an int, got {value!r}")
        object.__setattr__(self, "behaviors", tuple(self.behaviors))
        for b in self.behaviors:
            if not isinstance(b, Behavior):
                raise ValueError(f"profile behaviors must be Behavior objects, got {type(b).__name__}")

    @property
    def state(self) -> dict[str, int]:
        """The initial state as {dimension: value}."""
        return {dim: getattr(self, dim) for dim in STATE_DIMS}

    @property
    def state_key(self) -> str:
        """A stable key of the initial state, e.g. "c2-e1-t3" (behaviours are not part of it)."""
        return f"c{self.cooperation}-e{self.emotion}-t{self.trust}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: the three dimensions plus "behaviors" as a list of {"category", "behavior"}."""
        return {**self.state, "behaviors": [b.to_dict() for b in self.behaviors]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "UserProfile":
        """Inverse of to_dict; ValueError naming the key on a missing or mistyped field."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a profile must be an object, got {type(d).__name__}")
        extra = set(d) - {*STATE_DIMS, "behaviors"}
        if extra:
            raise ValueError(f"unknown profile key(s) {sorted(extra)}")
        for dim in STATE_DIMS:
            if dim not in d:
                raise ValueError(f"profile is missing {dim!r}")
        raw = d.get("behaviors", [])
        if not isinstance(raw, (list, tuple)):
            raise ValueError("profile 'behaviors' must be a list")
        behaviors = []
        for i, b in enumerate(raw):
            try:
                behaviors.append(Behavior.from_dict(b))
            except ValueError as exc:
                raise ValueError(f"profile behaviors[{i}]: {exc}") from None
        return cls(*(d[dim] for dim in STATE_DIMS), behaviors=tuple(behaviors))


@dataclass(frozen=True)
class ParsedTurn:
    """What agent and user turns share: the raw text, the spoken reply, the status, the state (the user's own or
    the agent's estimates), the think text, the parse's flags and whether the reply could not be read."""

    raw: str
    reply: str | None
    status: int | None = None
    cooperation: int | None = None
    emotion: int | None = None
    trust: int | None = None
    think: str | None = None
    flags: tuple[str, ...] = ()
    parse_error: bool = False

    @property
    def state(self) -> dict[str, int | None]:
        """The state values (the user's own, or the agent's estimates) as {dimension: value or None}."""
        return {dim: getattr(self, dim) for dim in STATE_DIMS}

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

    act_min_cooperation: int
    hang_up_at: dict[str, int]
    doubt_patience: int
    max_words: int = 60
    max_topics: int = 8
    act_min_trust: int | None = None  # None: trust does not gate acting


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
