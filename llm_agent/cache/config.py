"""Settings of the user-response cache (`rollout_loop.config.cache`), checked on construction."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl.trainer.config_ranges import check_number
from verl.trainer.config_schema import ConfigError
from verl.trainer.config_validation import ConfigSection, config_key

__all__ = ["CacheConfig", "is_int"]


def is_int(value: Any) -> bool:
    """True for an int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def _default_rates() -> dict[int, float]:
    """The original's per-stage hit rates (stage 3 and later: never served)."""
    return {0: 0.9, 1: 0.5, 2: 0.2, 3: 0.0}


@dataclass
class CacheConfig(ConfigSection):
    """Settings of :class:`UserResponseCache` (see docs/rollout_loop.md); checked on construction (ConfigError
    naming the key)."""

    SECTION_KEY = "cache"

    enabled: bool = True
    path: str | None = "outputs/cache/user_responses.jsonl"
    stage_hit_rates: dict[int, float] = field(default_factory=_default_rates)
    default_hit_rate: float = 0.0
    min_bucket_size: int = 10
    max_per_stage: int = 500
    max_total: int = 10000
    state_buckets: int = 3
    seed: int = 0
    max_reply_bytes: int = 64 << 10  # a reply longer than this (UTF-8) is neither stored nor read back from the file

    def __post_init__(self) -> None:
        if self.path is not None and not self.path.strip():
            raise ConfigError(f"{config_key('path')} must be a non-empty string or null, got {self.path!r}")
        rates: dict[int, float] = {}
        for key, rate in self.stage_hit_rates.items():
            stage = int(key) if isinstance(key, str) and key.strip().isdigit() else key
            if not is_int(stage) or stage < 0:
                raise ConfigError(f"{config_key('stage_hit_rates')} key {key!r} is not a stage id (an int >= 0)")
            if stage in rates:
                raise ConfigError(f"{config_key('stage_hit_rates')} lists stage {stage} twice")
            check_number(f"{config_key('stage_hit_rates')}[{key!r}]", rate, 0.0, 1.0)
            rates[stage] = float(rate)
        self.stage_hit_rates = rates
        check_number(config_key("default_hit_rate"), self.default_hit_rate, 0.0, 1.0)
        for name in ("min_bucket_size", "max_per_stage", "max_total", "state_buckets", "max_reply_bytes"):
            if not is_int(getattr(self, name)):
                raise ConfigError(f"{config_key(name)} must be an integer, got {getattr(self, name)!r}")
            check_number(config_key(name), getattr(self, name), 1)
        if self.min_bucket_size > self.max_per_stage:
            raise ConfigError(f"{config_key('min_bucket_size')} ({self.min_bucket_size}) exceeds "
                              f"{config_key('max_per_stage')} ({self.max_per_stage}): the cache could never serve a "
                              "reply")
