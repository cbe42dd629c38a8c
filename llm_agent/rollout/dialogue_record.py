"""The typed dialogue record: made once by the rollout loop, read by the reward, metrics, diagnosis, logs and
evaluation.

A `DialogueRecord` is one dialogue: who it was with (`profile`, `state_key`), how it ended (`outcome`, `error`),
its `turns` (one `TurnRecord` per agent turn: what the agent wrote and what the user side answered), the agent-side
`messages`, counters and what it cost; the diagnosis adds each turn's `signals` (`TurnSignals`) and `diagnosis`
and the record's `labels`; the reward adds `reward`, `reward_components` and `turn_rewards`. In a batch the records
travel in one `non_tensor_batch[DIALOGUE_KEY]` column (beside the trainer's `uid`), so every reader gets the
objects the loop made, never a re-parse.

A rollout-log line is `to_dict()` with the `step` and `split` first, the JSON the logs have always held
(docs/rollout_loop.md); `from_dict` reads such a line back, validating it once (errors name the record) and
tolerating what older logs lack (no labels, signals, costs or policy versions) and keys it does not know (kept in
`extra`, written back by `to_dict`).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llm_agent.rollout.outcome import Outcome

if TYPE_CHECKING:  # the metrics and the CLIs on them read records without torch
    from verl.protocol import DataProto

__all__ = ["DIALOGUE_KEY", "HUMAN_USER_SOURCE", "OUTCOMES", "DialogueRecord", "TurnRecord", "TurnSignals",
           "records_from_batch"]

HUMAN_USER_SOURCE = "human"  # `user_source` of a turn a person wrote (python -m for_evaluation.chat)

DIALOGUE_KEY = "dialogue"  # the non_tensor_batch column of the records
OUTCOMES: tuple[str, ...] = tuple(outcome.value for outcome in Outcome)
_LOOP = "llm_agent.generation.LLMGenerationManager"


def _copy(state: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return None if state is None else dict(state)


def _shown(value: Any) -> str:
    """A logged value as an error message shows it: its repr, cut at 60 characters (a log line may be hostile)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:60]}... ({type(value).__name__} of {len(text)} characters)"


def _int_or_none(value: Any, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an integer or null, got {_shown(value)}")
    return value


def _state_or_none(value: Any, what: str) -> dict[str, int | None] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} must be an object of dimension -> integer, got {type(value).__name__}")
    return {str(k): _int_or_none(v, f"{what}.{k}") for k, v in value.items()}


def _str_or_none(value: Any, what: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{what} must be a string or null, got {type(value).__name__}")
    return value


@dataclass
class TurnSignals:
    """What one agent turn did to the user and the call (`llm_agent.diagnosis.signals` defines each)."""

    state_before: dict[str, int]
    state_delta: dict[str, int] | None
    state_change: float
    stage_reached: int | None
    new_stage: bool
    stage_progress: float
    format_error: bool
    outcome_share: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"state_before": dict(self.state_before), "state_delta": None if self.state_delta is None else
                dict(self.state_delta), "state_change": self.state_change, "stage_reached": self.stage_reached,
                "new_stage": self.new_stage, "stage_progress": self.stage_progress,
                "format_error": self.format_error, "outcome_share": self.outcome_share}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "TurnSignals":
        """Inverse of to_dict; ValueError naming `where`."""
        try:
            return cls(dict(d["state_before"]), None if d["state_delta"] is None else dict(d["state_delta"]),
                       float(d["state_change"]), d["stage_reached"], bool(d["new_stage"]),
                       float(d["stage_progress"]), bool(d["format_error"]), float(d.get("outcome_share", 0.0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: malformed signals ({exc!r})") from None


@dataclass
class TurnRecord:
    """One agent turn and what the user side answered to it (None fields: nothing of that kind happened).

    `user_source` says where the answer came from: `simulator`, `cache`, `human` (a person's, in a human call),
    `format_error` (the loop's note), or None when no user turn followed. `policy_version` is the policy's version
    that sampled the agent's tokens (None where the engine did not say). `signals` and `diagnosis` are set by
    `llm_agent.diagnosis`.
    """

    agent_text: str
    agent_reply: str | None = None
    agent_stage: int | None = None
    agent_status: int | None = None
    agent_state: dict[str, int | None] | None = None
    agent_format_ok: bool = True
    user_reply: str | None = None
    user_status: int | None = None
    user_state: dict[str, int | None] | None = None
    user_source: str | None = None
    user_error: str | None = None
    policy_version: int | None = None
    signals: TurnSignals | None = None
    diagnosis: list[dict[str, str]] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the rollout log's turn object); signals and diagnosis only once set."""
        out = {"agent_text": self.agent_text, "agent_reply": self.agent_reply, "agent_stage": self.agent_stage,
               "agent_status": self.agent_status, "agent_state": _copy(self.agent_state),
               "agent_format_ok": self.agent_format_ok, "user_reply": self.user_reply, "user_status": self.user_status,
               "user_state": _copy(self.user_state), "user_source": self.user_source, "user_error": self.user_error,
               "policy_version": self.policy_version}
        if self.signals is not None:
            out["signals"] = self.signals.to_dict()
        if self.diagnosis is not None:
            out["diagnosis"] = [dict(entry) for entry in self.diagnosis]
        return out

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "TurnRecord":
        """A turn object of a log (keys it lacks are None); ValueError naming `where` when a field is mistyped."""
        if not isinstance(d, Mapping):
            raise ValueError(f"{where}: a turn must be an object, got {type(d).__name__}")
        text = d.get("agent_text")
        ok = d.get("agent_format_ok", True)
        diagnosis = d.get("diagnosis")
        if diagnosis is not None and (not isinstance(diagnosis, list) or not all(
                isinstance(e, Mapping) and isinstance(e.get("label"), str) for e in diagnosis)):
            raise ValueError(f"{where}.diagnosis must be a list of {{label, note}} objects")
        return cls(
            agent_text="" if text is None else _str_or_none(text, f"{where}.agent_text"),
            agent_reply=_str_or_none(d.get("agent_reply"), f"{where}.agent_reply"),
            agent_stage=_int_or_none(d.get("agent_stage"), f"{where}.agent_stage"),
            agent_status=_int_or_none(d.get("agent_status"), f"{where}.agent_status"),
            agent_state=_state_or_none(d.get("agent_state"), f"{where}.agent_state"),
            agent_format_ok=bool(ok),
            user_reply=_str_or_none(d.get("user_reply"), f"{where}.user_reply"),
            user_status=_int_or_none(d.get("user_status"), f"{where}.user_status"),
            user_state=_state_or_none(d.get("user_state"), f"{where}.user_state"),
            user_source=_str_or_none(d.get("user_source"), f"{where}.user_source"),
            user_error=_str_or_none(d.get("user_error"), f"{where}.user_error"),
            policy_version=_int_or_none(d.get("policy_version"), f"{where}.policy_version"),
            signals=None if d.get("signals") is None else TurnSignals.from_dict(d["signals"], f"{where}.signals"),
            diagnosis=None if diagnosis is None else [dict(e) for e in diagnosis])


@dataclass
class DialogueRecord:
    """One dialogue (see the module docstring). `num_turns` is the number of agent turns, `len(turns)`."""

    dialogue_id: str
    outcome: str
    turns: list[TurnRecord]
    uid: str = ""
    profile: dict[str, Any] = field(default_factory=dict)
    state_key: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    cache_hits: int = 0
    format_errors: int = 0
    sim_retries: int = 0
    error: str | None = None
    labels: dict[str, int] | None = None
    agent_tokens: int | None = None
    sim_requests: int | None = None
    wall_s: float | None = None
    reward: float | None = None
    reward_components: dict[str, float] | None = None
    turn_rewards: list[float] | None = None
    step: int | None = None
    split: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_turns(self) -> int:
        """Agent turns of the dialogue."""
        return len(self.turns)

    @property
    def annotated(self) -> bool:
        """True once the diagnosis has set the labels and every turn's signals and findings."""
        return self.labels is not None and all(t.signals is not None and t.diagnosis is not None for t in self.turns)

    def initial_state(self, dims: Sequence[str], where: str) -> dict[str, int]:
        """The profile's initial value of each of `dims`; ValueError naming `where` when one is not an int."""
        profile = self.profile
        if any(isinstance(profile.get(d), bool) or not isinstance(profile.get(d), int) for d in dims):
            raise ValueError(f"{where}: 'profile' must hold integer {list(dims)}, got {_shown(profile)}")
        return {d: int(profile[d]) for d in dims}

    def to_dict(self) -> dict[str, Any]:
        """The rollout log's JSON object (`step` and `split` first; keys in the log's order; `extra` last)."""
        return {"step": self.step, "split": self.split, "uid": self.uid, "dialogue_id": self.dialogue_id,
                "profile": self.profile, "state_key": self.state_key, "outcome": self.outcome,
                "num_turns": self.num_turns, "turns": [t.to_dict() for t in self.turns], "messages": self.messages,
                "reward": self.reward, "reward_components": self.reward_components,
                "turn_rewards": self.turn_rewards, "cache_hits": self.cache_hits,
                "format_errors": self.format_errors, "sim_retries": self.sim_retries, "error": self.error,
                "labels": self.labels, "agent_tokens": self.agent_tokens, "sim_requests": self.sim_requests,
                "wall_s": self.wall_s, **self.extra}

    @classmethod
    def from_dict(cls, d: Any, where: str = "record") -> "DialogueRecord":
        """A log line read back (see the module docstring); ValueError naming `where` and the field."""
        if not isinstance(d, Mapping):
            raise ValueError(f"{where}: a record must be an object, got {type(d).__name__}")
        for key in ("outcome", "turns"):
            if key not in d:
                raise KeyError(f"{where}: the record has no {key!r} (keys: {_shown(sorted(map(str, d)))})")
        if d["outcome"] not in OUTCOMES:
            raise ValueError(f"{where}: outcome {_shown(d['outcome'])} is not one of {list(OUTCOMES)}")
        raw_turns = d["turns"]
        if not isinstance(raw_turns, (list, tuple)):
            raise ValueError(f"{where}: 'turns' must be a list of turn dicts, got {type(raw_turns).__name__}")
        turns = [TurnRecord.from_dict(t, f"{where}: turn {k}") for k, t in enumerate(raw_turns)]
        if d.get("num_turns") is not None and _count(d, "num_turns", where) != len(turns):
            raise ValueError(f"{where}: num_turns={d['num_turns']} but the record holds {len(turns)} turns")
        profile = d.get("profile") or {}
        if not isinstance(profile, Mapping):
            raise ValueError(f"{where}: 'profile' must be an object, got {type(profile).__name__}")
        known = {"step", "split", "uid", "dialogue_id", "profile", "state_key", "outcome", "num_turns", "turns",
                 "messages", "reward", "reward_components", "turn_rewards", "cache_hits", "format_errors",
                 "sim_retries", "error", "labels", "agent_tokens", "sim_requests", "wall_s"}
        return cls(
            dialogue_id=str(d.get("dialogue_id", "")), outcome=d["outcome"], turns=turns, uid=str(d.get("uid", "")),
            profile=dict(profile), state_key=_str_or_none(d.get("state_key"), f"{where}.state_key"),
            messages=list(d.get("messages") or []), cache_hits=_count(d, "cache_hits", where, 0),
            format_errors=_count(d, "format_errors", where, 0), sim_retries=_count(d, "sim_retries", where, 0),
            error=_str_or_none(d.get("error"), f"{where}.error"), labels=_labels(d.get("labels"), where),
            agent_tokens=_cost(d, "agent_tokens", where), sim_requests=_cost(d, "sim_requests", where),
            wall_s=_cost(d, "wall_s", where, integral=False), reward=d.get("reward"),
            reward_components=d.get("reward_components"), turn_rewards=d.get("turn_rewards"),
            step=d.get("step"), split=d.get("split"), extra={k: v for k, v in d.items() if k not in known})


def _count(d: Mapping[str, Any], key: str, where: str, default: int | None = None) -> int:
    """d[key] as a non-negative int (`default` when absent, or a KeyError naming `where` without one)."""
    if d.get(key) is None:
        if default is None:
            raise KeyError(f"{where}: the record has no {key!r} (keys: {_shown(sorted(map(str, d)))})")
        return default
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}: {key!r} must be a non-negative int, got {_shown(value)}")
    return value


def _cost(d: Mapping[str, Any], key: str, where: str, integral: bool = True) -> Any:
    """A cost field (None when absent: an older log); ValueError unless a finite number >= 0."""
    value = d.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: {key!r} must be a finite number >= 0, got {_shown(value)}")
    return int(value) if integral and float(value).is_integer() else value


def _labels(value: Any, where: str) -> dict[str, int] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or any(isinstance(n, bool) or not isinstance(n, int) for n in value.values()):
        raise ValueError(f"{where}: 'labels' must be an object of label -> turns")
    return {str(k): int(n) for k, n in value.items()}


def records_from_batch(data: DataProto) -> list[DialogueRecord]:
    """The records of a batch's rows, in row order (the loop's own objects); KeyError naming the rollout loop when
    the batch has none."""
    column = data.non_tensor_batch.get(DIALOGUE_KEY)
    if column is None:
        raise KeyError(f"non_tensor_batch has no {DIALOGUE_KEY!r} column (got {sorted(data.non_tensor_batch)}); "
                       f"dialogue rewards and metrics need the records written by the rollout loop, so set "
                       f"rollout_loop.path={_LOOP}")
    records = list(column)
    for i, record in enumerate(records):
        if not isinstance(record, DialogueRecord):
            raise TypeError(f"non_tensor_batch[{DIALOGUE_KEY!r}][{i}] is a {type(record).__name__}, not a "
                            "DialogueRecord")
    return records
