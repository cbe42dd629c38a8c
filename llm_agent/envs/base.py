"""The environment contract of the rollout loop and the registry of environment kinds.

An environment is one episode on one row of a generation batch: the loop's schedulers (sync and async) hand it the
policy's sampled turns (`step`) and the simulator's answers to the requests it makes (`answer`), and it decides
what the row's context gets next and when the episode ends; it does no I/O itself. Every kind shares the
constructor `cls(context, buffer, row, uid, dialogue_id)` and `reset(profile)`, and gives its `record()` (a
`DialogueRecord`) when the episode is over.

Kinds are registered by name (`register_env("dialogue", DialogueEnv)`, or an entry point `"pkg.module:Class"`
imported on first use) and chosen per run by `rollout_loop.config.env` and per row by the dataset column
`env_class` (as SkyRL's `env_class`); a dotted class path also names a kind. Registration refuses a class that is
not an `Environment` or leaves a method of the contract unimplemented, naming it.
"""
from __future__ import annotations

import abc
import importlib
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llm_agent.rollout.dialogue_record import DialogueRecord, TurnRecord
from llm_agent.rollout.outcome import Outcome
from llm_agent.user_sim.client import TurnRequest, TurnResult

if TYPE_CHECKING:
    from llm_agent.cache import UserResponseCache
    from llm_agent.rollout.dialogue import ChatMarkers, TokenBuffer
    from llm_agent.rollout.generation_call import SampledTurn
    from llm_agent.scenario import Scenario, UserProfile
    from llm_agent.user_sim.client import UserSimConfig

__all__ = ["ENV_COLUMN", "EnvContext", "Environment", "Step", "env_class", "register_env", "registered_envs"]

ENV_COLUMN = "env_class"  # the dataset column that picks a row's environment kind


@dataclass(frozen=True)
class EnvContext:
    """What every environment of one rollout call shares: the scenario, the tokenizer and its chat markers, the
    limits, the simulator's sampling settings, the loop's notes for unreadable turns, the cache (None: no cache)
    and the simulator request seeds (`seeds(dialogue, turn, attempt)`)."""

    scenario: Scenario
    tokenizer: Any
    markers: ChatMarkers
    eos_id: int
    max_turns: int
    max_user_tokens: int
    user_sim: UserSimConfig
    format_error_message: str
    range_error_message: str
    cache: UserResponseCache | None
    seeds: Any


@dataclass(frozen=True)
class Step:
    """What one `Environment.step` or `.answer` did.

    `request`: the simulator must answer it (pass its answer to `answer`) before the turn is complete;
    `user_ids`: the user turn appended to the context (role markers included; None when none was); `outcome`: set
    once the episode has ended; `record`: the turn's record.
    """

    record: TurnRecord
    request: TurnRequest | None = None
    user_ids: list[int] | None = None
    outcome: Outcome | None = None


class Environment(abc.ABC):
    """One episode on row `row` of `buffer` (see the module docstring). `ended_at`: the `time.monotonic()` reading
    when the episode got its outcome (the loop's pacing metrics)."""

    ended_at: float | None = None

    def __init__(self, context: EnvContext, buffer: TokenBuffer, row: int, uid: str, dialogue_id: str) -> None:
        self.context, self.buffer, self.row, self.uid, self.dialogue_id = context, buffer, row, uid, dialogue_id

    @abc.abstractmethod
    def reset(self, profile: UserProfile) -> None:
        """Start the episode with the simulated user `profile` (the row's prompt is already in the buffer)."""

    @property
    @abc.abstractmethod
    def active(self) -> bool:
        """True from `reset` until the episode has an outcome."""

    @abc.abstractmethod
    def step(self, turn: SampledTurn) -> Step:
        """Take the policy's next turn (its sampled ids, their log-probs and the policy version)."""

    @abc.abstractmethod
    def answer(self, result: TurnResult) -> Step:
        """Take the simulator's answer to the request the last step made."""

    @abc.abstractmethod
    def record(self) -> DialogueRecord:
        """The finished episode's record."""


_REGISTRY: dict[str, type[Environment] | str] = {}


def _checked(name: str, cls: Any) -> type[Environment]:
    """`cls` when it is a complete Environment subclass; TypeError naming `name` and what is wrong otherwise."""
    if not (inspect.isclass(cls) and issubclass(cls, Environment)):
        raise TypeError(f"environment {name!r}: {cls!r} is not a subclass of llm_agent.envs.Environment")
    missing = sorted(cls.__abstractmethods__)
    if missing:
        raise TypeError(f"environment {name!r}: {cls.__name__} does not implement {missing} of the Environment "
                        "contract")
    return cls


def register_env(name: str, entry_point: type[Environment] | str) -> None:
    """Register an environment kind under `name`: a class (checked now) or `"pkg.module:Class"` (checked when first
    used). ValueError when `name` is taken by another kind."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"an environment name must be a non-empty string, got {name!r}")
    if not isinstance(entry_point, str):
        _checked(name, entry_point)
    if name in _REGISTRY and _REGISTRY[name] != entry_point:
        raise ValueError(f"environment {name!r} is already registered ({_REGISTRY[name]!r})")
    _REGISTRY[name] = entry_point


def registered_envs() -> list[str]:
    """The registered kinds' names, sorted."""
    return sorted(_REGISTRY)


def _import(path: str, name: str) -> Any:
    module, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module or not sep or not attr:
        raise KeyError(f"environment {name!r}: {path!r} is neither a registered kind ({registered_envs()}) nor a "
                       "class path (pkg.module.Class)")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise KeyError(f"environment {name!r}: cannot import {path!r} ({exc})") from None


def env_class(name: str) -> type[Environment]:
    """The class of the environment kind `name`: a registered name or a class path; KeyError naming the
    registered kinds when neither, TypeError when the class breaks the contract."""
    entry = _REGISTRY.get(name)
    if entry is None:
        if not isinstance(name, str) or "." not in name:
            raise KeyError(f"unknown environment {name!r}; registered: {registered_envs()} (or give a class path)")
        entry = name
    cls = _checked(name, _import(entry, name) if isinstance(entry, str) else entry)
    _REGISTRY.setdefault(name, cls)
    return cls
