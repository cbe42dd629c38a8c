"""Typed configuration of the SEAD rollout loop (`rollout_loop.config` of the trainer).

`GenerationConfig.from_dict(mapping)` checks the free-form mapping the trainer passes to
`llm_agent.generation.LLMGenerationManager` and returns frozen-by-convention dataclasses; every problem raises
`ConfigError` naming the key as `rollout_loop.config.<key>` (nested keys dotted). The `cache` and `controller`
sub-mappings are checked by `CacheConfig.from_dict` / `ControllerConfig.from_dict` of their own modules.

The per-dialogue budget must fit `max_turns` turns: `max_response_length >= max_turns * (min(max_tokens_per_turn,
MIN_AGENT_TURN_TOKENS) + MIN_USER_TURN_TOKENS)`. With less, no dialogue could take its last turn, so no call
could use all the turns it is given. The two constants are lower bounds on a real turn, so the rule never
rejects a budget that short real turns fit: a well-formed agent turn of the shipped scenarios (six tags with
one-digit values, the reply "Hi.") is 71 tokens with the tiny test tokenizer and, by estimate, about 55 with a
large BPE vocabulary such as Qwen2.5's (MIN_AGENT_TURN_TOKENS = 48); a user turn is the chat template's role
markers (13 tokens with the tiny tokenizer's ChatML template, 8 with Qwen2.5's single-token `<|im_start|>` /
`<|im_end|>`) around at least a word or two (MIN_USER_TURN_TOKENS = 10). A budget that fits `max_turns` turns
only when they are short (less than `max_turns * (max_tokens_per_turn + max_user_tokens + MIN_USER_TURN_TOKENS)`)
is logged as a warning: long dialogues then end as `truncated`.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llm_agent.cache import CacheConfig
from llm_agent.config_checks import checked_mapping
from llm_agent.controller import ControllerConfig

__all__ = ["AsyncRolloutConfig", "ConfigError", "GenerationConfig", "LOOP_MODES", "UserSimConfig", "ROOT_KEY", "MIN_AGENT_TURN_TOKENS",
           "MIN_USER_TURN_TOKENS"]

logger = logging.getLogger(__name__)

ROOT_KEY = "rollout_loop.config"
REPO_ROOT = Path(__file__).resolve().parents[2]
MIN_AGENT_TURN_TOKENS = 48  # below the shortest well-formed agent turn (all tags, a one-word reply)
MIN_USER_TURN_TOKENS = 10  # below the role markers around a user turn plus a word or two of reply
LOOP_MODES = ("sync", "async")


class ConfigError(ValueError):
    """A rollout-loop config value is missing, unknown or invalid; the message names the full key."""


def _plain(value: Any) -> Any:
    """Turn OmegaConf containers (or any Mapping / non-string Sequence) into plain dicts and lists."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [_plain(v) for v in value]
    return value


def _number(data: Mapping[str, Any], key: str, default: Any, where: str, *, kind: type = int,
            minimum: float | None = None, allow_none: bool = False) -> Any:
    """Read `data[key]` as an int or float (bools rejected) with an optional lower bound."""
    value = data.get(key, default)
    if value is None and allow_none:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        ok = ok and float(value).is_integer()
    if not ok:
        raise ConfigError(f"{where}.{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    value = kind(value)
    if minimum is not None and value < minimum:
        raise ConfigError(f"{where}.{key} must be >= {minimum}, got {value}")
    return value


def _flag(data: Mapping[str, Any], key: str, default: bool, where: str) -> bool:
    """Read `data[key]` as a bool."""
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}.{key} must be true or false, got {value!r}")
    return value


def _fraction(data: Mapping[str, Any], key: str, default: float, where: str) -> float:
    """Read `data[key]` as a number in [0, 1]."""
    value = _number(data, key, default, where, kind=float, minimum=0.0)
    if value > 1:
        raise ConfigError(f"{where}.{key} must be in [0, 1], got {value}")
    return value


def _optional_str(data: Mapping[str, Any], key: str, where: str) -> str | None:
    """Read `data[key]` as a non-empty string or None."""
    value = data.get(key)
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ConfigError(f"{where}.{key} must be a non-empty string or null, got {value!r}")
    return value


@dataclass
class UserSimConfig:
    """How to reach the user simulator: the `UserSimClient` arguments and the simulator's sampling settings."""

    urls: list[str] | None = None
    model: str | None = None
    api_key: str | None = None
    timeout_s: float = 60.0
    max_attempts: int = 3
    deadline_s: float | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    reply_retries: int = 2
    check_at_start: bool = True
    max_error_rate: float = 0.5
    error_patience: int = 3

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "UserSimConfig":
        """Check `data` (a mapping or None); `urls` may be a comma-separated string or a list of strings."""
        data = checked_mapping(data, cls, where, ConfigError)
        urls = data.get("urls")
        if isinstance(urls, str):
            urls = [u for u in urls.split(",") if u.strip()]
        if urls is not None and (not isinstance(urls, list) or not all(isinstance(u, str) for u in urls)):
            raise ConfigError(f"{where}.urls must be a comma-separated string or a list of strings, got {urls!r}")
        top_p = _number(data, "top_p", 1.0, where, kind=float)
        if not 0 < top_p <= 1:
            raise ConfigError(f"{where}.top_p must be in (0, 1], got {top_p}")
        deadline = _number(data, "deadline_s", None, where, kind=float, allow_none=True)
        if deadline is not None and deadline <= 0:
            raise ConfigError(f"{where}.deadline_s must be > 0 or null, got {deadline}")
        timeout = _number(data, "timeout_s", 60.0, where, kind=float)
        if timeout <= 0:
            raise ConfigError(f"{where}.timeout_s must be > 0, got {timeout}")
        return cls(urls=urls or None, model=_optional_str(data, "model", where),
                   api_key=_optional_str(data, "api_key", where), timeout_s=timeout,
                   max_attempts=_number(data, "max_attempts", 3, where, minimum=1), deadline_s=deadline,
                   temperature=_number(data, "temperature", 1.0, where, kind=float, minimum=0.0),
                   top_p=top_p, max_tokens=_number(data, "max_tokens", 256, where, minimum=1),
                   reply_retries=_number(data, "reply_retries", 2, where, minimum=0),
                   check_at_start=_flag(data, "check_at_start", True, where),
                   max_error_rate=_fraction(data, "max_error_rate", 0.5, where),
                   error_patience=_number(data, "error_patience", 3, where, minimum=1))


@dataclass
class AsyncRolloutConfig:
    """How the async loop batches agent-turn requests per rollout replica (see llm_agent/rollout/async_engine.py).

    `batch_wait_ms`: how long a free replica waits after the oldest queued request for more to join its batch;
    `max_batch_size`: the most requests one `generate_sequences` call carries.
    """

    batch_wait_ms: float = 5.0
    max_batch_size: int = 256

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "AsyncRolloutConfig":
        """Check `data` (a mapping or None)."""
        data = checked_mapping(data, cls, where, ConfigError)
        return cls(batch_wait_ms=_number(data, "batch_wait_ms", 5.0, where, kind=float, minimum=0.0),
                   max_batch_size=_number(data, "max_batch_size", 256, where, minimum=1))


@dataclass
class GenerationConfig:
    """Everything the rollout loop reads from `rollout_loop.config`.

    `max_tokens_per_turn` bounds one agent turn; `max_response_length` is the per-trajectory budget R (all
    agent turns, user blocks and role markers together; the `responses` tensor is exactly R wide);
    `max_user_tokens` bounds the spoken user reply inserted per turn. `format_error_message` is the user turn
    shown to the agent when its output has no reply tag (null: a default naming the tag).
    `seed` seeds the simulator requests (per rollout call, dialogue and turn). `mode` is `sync` (every turn,
    all active dialogues generate as one batch, then all wait for the simulator) or `async` (each dialogue runs
    at its own pace; `async_rollout` tunes the batching of its agent turns).
    """

    scenario: str
    mode: str = "sync"
    async_rollout: AsyncRolloutConfig = field(default_factory=AsyncRolloutConfig)
    max_turns: int = 10
    max_tokens_per_turn: int = 256
    max_response_length: int = 2048
    max_user_tokens: int = 256
    user_sim: UserSimConfig = field(default_factory=UserSimConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    rollout_log_path: str | None = None
    val_metrics_path: str | None = None
    seed: int = 0
    format_error_message: str | None = None

    @classmethod
    def from_dict(cls, data: Any, where: str = ROOT_KEY) -> "GenerationConfig":
        """Check the trainer's mapping; ConfigError names `rollout_loop.config.<key>` for any problem."""
        data = checked_mapping(_plain(data), cls, where, ConfigError)
        scenario = data.get("scenario")
        if not isinstance(scenario, str) or not scenario.strip():
            raise ConfigError(f"{where}.scenario is required: the path of a format_prompt/<name>.yaml file")
        scenario_path = resolve_path(scenario)
        if scenario_path is None:
            raise ConfigError(f"{where}.scenario: file not found: {scenario!r} (looked in the working directory "
                              f"and in {REPO_ROOT})")
        max_turns = _number(data, "max_turns", 10, where, minimum=1)
        per_turn = _number(data, "max_tokens_per_turn", 256, where, minimum=1)
        budget = _number(data, "max_response_length", 2048, where, minimum=1)
        if budget < per_turn:
            raise ConfigError(f"{where}.max_response_length ({budget}) must be >= "
                              f"{where}.max_tokens_per_turn ({per_turn})")
        check_budget_fits_turns(budget, max_turns, per_turn, _number(data, "max_user_tokens", 256, where, minimum=1),
                                where)
        message = _optional_str(data, "format_error_message", where)
        mode = data.get("mode", "sync")
        if mode not in LOOP_MODES:
            raise ConfigError(f"{where}.mode must be one of {list(LOOP_MODES)}, got {mode!r}")
        try:
            cache = CacheConfig.from_dict(data.get("cache") or {}, f"{where}.cache")
            controller = ControllerConfig.from_dict(data.get("controller") or {}, f"{where}.controller")
        except ConfigError:
            raise
        except (TypeError, ValueError) as exc:
            raise ConfigError(str(exc)) from None
        return cls(scenario=str(scenario_path), mode=mode,
                   async_rollout=AsyncRolloutConfig.from_dict(data.get("async_rollout"), f"{where}.async_rollout"),
                   max_turns=max_turns, max_tokens_per_turn=per_turn,
                   max_response_length=budget, max_user_tokens=_number(data, "max_user_tokens", 256, where, minimum=1),
                   user_sim=UserSimConfig.from_dict(data.get("user_sim"), f"{where}.user_sim"), cache=cache,
                   controller=controller, rollout_log_path=_optional_str(data, "rollout_log_path", where),
                   val_metrics_path=_optional_str(data, "val_metrics_path", where),
                   seed=_number(data, "seed", 0, where), format_error_message=message)


def check_budget_fits_turns(budget: int, max_turns: int, per_turn: int, user_tokens: int, where: str) -> None:
    """Raise ConfigError when `budget` cannot fit `max_turns` minimal turns; warn when it cannot fit them at
    their limits (`per_turn` agent tokens and `user_tokens` of reply each)."""
    minimal_turn = min(per_turn, MIN_AGENT_TURN_TOKENS) + MIN_USER_TURN_TOKENS
    if budget < max_turns * minimal_turn:
        raise ConfigError(
            f"{where}.max_response_length ({budget}) cannot fit {where}.max_turns ({max_turns}) turns: each needs "
            f"at least {minimal_turn} tokens (min(max_tokens_per_turn={per_turn}, {MIN_AGENT_TURN_TOKENS}) for a "
            f"minimal agent turn + {MIN_USER_TURN_TOKENS} for a minimal user turn), so the budget must be >= "
            f"{max_turns * minimal_turn}; raise data.max_response_length or lower max_turns")
    full_turn = per_turn + user_tokens + MIN_USER_TURN_TOKENS
    if budget < max_turns * full_turn:
        logger.warning("%s.max_response_length (%d) fits %d of the %d turns at their limits (%d agent + %d user "
                       "tokens + role markers each); dialogues with long turns end as `truncated`", where, budget,
                       budget // full_turn, max_turns, per_turn, user_tokens)


def resolve_path(path: str) -> Path | None:
    """`path` if it names a file, else the same path under the repository root if that is a file, else None."""
    for candidate in (Path(path), REPO_ROOT / path):
        if candidate.is_file():
            return candidate.resolve()
    return None
