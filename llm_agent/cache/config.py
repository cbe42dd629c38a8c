"""Settings of the user-response cache (`rollout_loop.config.cache`), checked on construction."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llm_agent.config_checks import checked_mapping

__all__ = ["CacheConfig", "is_int"]


def is_int(value: Any) -> bool:
    """True for an int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def _default_rates() -> dict[int, float]:
    """The original's per-stage hit rates (stage 3 and later: never served)."""
    return {0: 0.9, 1: 0.5, 2: 0.2, 3: 0.0}


@dataclass
class CacheConfig:
    """Settings of :class:`UserResponseCache`; validated on construction (ValueError naming the field)."""

    enabled: bool = True
    path: str | None = "outputs/cache/user_responses.jsonl"
    stage_hit_rates: dict[int, float] = field(default_factory=_default_rates)
    default_hit_rate: float = 0.0
    min_bucket_size: int = 10
    max_per_stage: int = 500
    max_total: int = 10000
    state_buckets: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"CacheConfig.enabled must be true or false, got {self.enabled!r}")
        if self.path is not None and (not isinstance(self.path, str) or not self.path.strip()):
            raise ValueError(f"CacheConfig.path must be a non-empty string or null, got {self.path!r}")
        if not isinstance(self.stage_hit_rates, Mapping):
            raise ValueError(f"CacheConfig.stage_hit_rates must be a mapping stage -> rate, "
                             f"got {type(self.stage_hit_rates).__name__}")
        rates: dict[int, float] = {}
        for key, rate in self.stage_hit_rates.items():
            stage = int(key) if isinstance(key, str) and key.strip().isdigit() else key
            if not is_int(stage) or stage < 0:
                raise ValueError(f"CacheConfig.stage_hit_rates key {key!r} is not a stage id (an int >= 0)")
            if stage in rates:
                raise ValueError(f"CacheConfig.stage_hit_rates lists stage {stage} twice")
            rates[stage] = self._rate(f"stage_hit_rates[{key!r}]", rate)
        self.stage_hit_rates = rates
        self.default_hit_rate = self._rate("default_hit_rate", self.default_hit_rate)
        for name in ("min_bucket_size", "max_per_stage", "max_total", "state_buckets"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"CacheConfig.{name} must be an int >= 1, got {value!r}")
        if self.min_bucket_size > self.max_per_stage:
            raise ValueError(f"CacheConfig.min_bucket_size ({self.min_bucket_size}) exceeds max_per_stage "
                             f"({self.max_per_stage}): the cache could never serve a reply")
        if not is_int(self.seed):
            raise ValueError(f"CacheConfig.seed must be an int, got {self.seed!r}")

    @staticmethod
    def _rate(name: str, value: Any) -> float:
        """A probability in [0, 1] as a float, or ValueError naming the field."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise ValueError(f"CacheConfig.{name} must be a number in [0, 1], got {value!r}")
        return float(value)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None, where: str = "cache") -> "CacheConfig":
        """Build from a config mapping (YAML/OmegaConf); ValueError prefixed by `where` on an unknown key or bad
        value. None or an empty mapping gives the defaults."""
        values = checked_mapping(d, cls, where)
        if isinstance(values.get("stage_hit_rates"), Mapping):
            values["stage_hit_rates"] = dict(values["stage_hit_rates"])
        try:
            return cls(**values)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
