"""Typed configuration of the SEAD rollout loop (`rollout_loop.config` of the trainer).

`GenerationConfig.from_dict(mapping)` builds the dataclasses below with the trainer's own coercer
(`verl.trainer.config_validation`): unknown keys and wrong types fail there, value checks live in each
dataclass's `__post_init__`, and every problem is a `ConfigError` (the engine's one class) naming the key as
`rollout_loop.config.<key>` (nested keys dotted). Every default is written once, here or in the block's own
module (`UserSimConfig` in `llm_agent/user_sim/client/config.py`, `CacheConfig` in `llm_agent/cache/config.py`,
`ControllerConfig` in `llm_agent/controller.py`); `verl/trainer/config/sead_trainer.yaml` repeats them (a test
says the values are equal).

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

import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from llm_agent.cache import CacheConfig
from llm_agent.controller import ControllerConfig
from llm_agent.rollout.judges import parse_judge_urls
from llm_agent.user_sim.client import UserSimConfig
from verl.trainer.config_ranges import check_number
from verl.trainer.config_schema import ConfigError
from verl.trainer.config_validation import ConfigSection, config_key

__all__ = ["AsyncRolloutConfig", "ConfigError", "GenerationConfig", "MIN_AGENT_TURN_TOKENS", "MIN_USER_TURN_TOKENS",
           "ROOT_KEY", "resolve_path"]

logger = logging.getLogger(__name__)

ROOT_KEY = "rollout_loop.config"
REPO_ROOT = Path(__file__).resolve().parents[2]
MIN_AGENT_TURN_TOKENS = 48  # below the shortest well-formed agent turn (all tags, a one-word reply)
MIN_USER_TURN_TOKENS = 10  # below the role markers around a user turn plus a word or two of reply


@dataclass
class AsyncRolloutConfig(ConfigSection):
    """How the async loop batches agent-turn requests per rollout replica (see llm_agent/rollout/async_engine.py).

    `batch_wait_ms`: how long a free replica waits after the oldest queued request for more to join its batch;
    `max_batch_size`: the most requests one `generate_sequences` call carries.
    """

    SECTION_KEY = "async_rollout"

    batch_wait_ms: float = 5.0
    max_batch_size: int = 256

    def __post_init__(self) -> None:
        check_number(config_key("batch_wait_ms"), self.batch_wait_ms, 0.0)
        check_number(config_key("max_batch_size"), self.max_batch_size, 1)


@dataclass
class GenerationConfig(ConfigSection):
    """Everything the rollout loop reads from `rollout_loop.config`.

    `scenario` (required) is the scenario YAML, relative to the working directory or the repository root. `env`
    is the environment kind every row runs in unless its dataset row names another in an `env_class` column: a
    name registered with `llm_agent.envs.register_env` (`dialogue`, the default) or a class path.
    `max_tokens_per_turn` bounds one agent turn; `max_response_length` is the per-trajectory budget R (all
    agent turns, user blocks and role markers together; the `responses` tensor is exactly R wide; the trainer sets
    it to `data.max_response_length`); `max_user_tokens` bounds the spoken user reply inserted per turn.
    `format_error_message` is the user turn shown to the agent when its output has no reply tag (null: a default
    naming the tag). `seed` seeds the simulator requests (per rollout call, dialogue and turn). `mode` is `sync`
    (every turn, all active dialogues generate as one batch, then all wait for the simulator) or `async` (each
    dialogue runs at its own pace; `async_rollout` tunes the batching of its agent turns). `rollout_log_path`
    (every dialogue, one JSON line each) and `val_metrics_path` (one line per validation) are not written when
    null. `judges` maps a name to other simulator instances' URLs that validation also runs against
    (`llm_agent/rollout/judges.py`); none by default.
    """

    SECTION_KEY = ROOT_KEY

    scenario: str | None = None
    env: str = "dialogue"
    mode: Literal["sync", "async"] = "sync"
    async_rollout: AsyncRolloutConfig = field(default_factory=AsyncRolloutConfig)
    max_turns: int = 10
    max_tokens_per_turn: int = 128
    max_response_length: int = 1024
    max_user_tokens: int = 128
    user_sim: UserSimConfig = field(default_factory=UserSimConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    rollout_log_path: str | None = None
    val_metrics_path: str | None = "outputs/evaluation/val_metrics.jsonl"
    seed: int = 0
    format_error_message: str | None = None
    judges: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.scenario is None or not self.scenario.strip():
            raise ConfigError(f"{config_key('scenario')} is required: the path of a format_prompt/<name>.yaml file")
        scenario_path = resolve_path(self.scenario)
        if scenario_path is None:
            raise ConfigError(f"{config_key('scenario')}: file not found: {self.scenario!r} (looked in the working "
                              f"directory and in {REPO_ROOT})")
        self.scenario = str(scenario_path)
        for name in ("max_turns", "max_tokens_per_turn", "max_response_length", "max_user_tokens"):
            check_number(config_key(name), getattr(self, name), 1)
        if self.max_response_length < self.max_tokens_per_turn:
            raise ConfigError(f"{config_key('max_response_length')} ({self.max_response_length}) must be >= "
                              f"{config_key('max_tokens_per_turn')} ({self.max_tokens_per_turn})")
        _check_budget_fits_turns(self.max_response_length, self.max_turns, self.max_tokens_per_turn,
                                self.max_user_tokens)
        if not self.env.strip():
            raise ConfigError(f"{config_key('env')} must name an environment kind, got {self.env!r}")
        self._check_judges()
        for name in ("rollout_log_path", "val_metrics_path", "format_error_message"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ConfigError(f"{config_key(name)} must be a non-empty string or null, got {value!r}")


    def _check_judges(self) -> None:
        """Parse `judges` ({name: URLs}); a judge sharing an instance with `user_sim.urls` is not independent."""
        try:
            self.judges = parse_judge_urls(self.judges, config_key("judges"))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        training = set(self.user_sim.urls or ())
        for name, urls in self.judges.items():
            if shared := sorted(training.intersection(urls)):
                raise ConfigError(f"{config_key('judges')}.{name} shares {shared} with "
                                  f"{config_key('user_sim')}.urls: a judge must be other simulator instances than "
                                  "the training ones")


def _check_budget_fits_turns(budget: int, max_turns: int, per_turn: int, user_tokens: int) -> None:
    """Raise ConfigError when `budget` cannot fit `max_turns` minimal turns; warn when it cannot fit them at
    their limits (`per_turn` agent tokens and `user_tokens` of reply each)."""
    minimal_turn = min(per_turn, MIN_AGENT_TURN_TOKENS) + MIN_USER_TURN_TOKENS
    if budget < max_turns * minimal_turn:
        raise ConfigError(
            f"{config_key('max_response_length')} ({budget}) cannot fit {config_key('max_turns')} ({max_turns}) "
            "turns: each needs "
            f"at least {minimal_turn} tokens (min(max_tokens_per_turn={per_turn}, {MIN_AGENT_TURN_TOKENS}) for a "
            f"minimal agent turn + {MIN_USER_TURN_TOKENS} for a minimal user turn), so the budget must be >= "
            f"{max_turns * minimal_turn}; raise data.max_response_length or lower max_turns")
    full_turn = per_turn + user_tokens + MIN_USER_TURN_TOKENS
    if budget < max_turns * full_turn:
        _warn_short_budget(config_key("max_response_length"), budget, budget // full_turn, max_turns, per_turn,
                           user_tokens)


@functools.lru_cache(maxsize=None)
def _warn_short_budget(key: str, budget: int, fitting: int, max_turns: int, per_turn: int, user_tokens: int) -> None:
    """The short-budget warning, once per process and settings (the training and validation loops check the same
    config)."""
    logger.warning("%s (%d) fits %d of the %d turns at their limits (%d agent + %d user tokens + role markers each); "
                   "dialogues with long turns end as `truncated`", key, budget, fitting, max_turns, per_turn, user_tokens)


def resolve_path(path: str) -> Path | None:
    """`path` if it names a file, else the same path under the repository root if that is a file, else None."""
    for candidate in (Path(path), REPO_ROOT / path):
        if candidate.is_file():
            return candidate.resolve()
    return None
