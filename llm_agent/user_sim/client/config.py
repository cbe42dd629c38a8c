"""`rollout_loop.config.user_sim`: where the simulators are, how the client reaches them, how they sample."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from llm_agent.user_sim.client.wire import parse_urls
from verl.trainer.config_ranges import check_number
from verl.trainer.config_schema import ConfigError
from verl.trainer.config_validation import ConfigSection, config_key

__all__ = ["UserSimConfig"]


@dataclass
class UserSimConfig(ConfigSection):
    """The simulator client's settings (`UserSimClient` arguments) and the simulator's sampling settings.

    `urls`: the instances' base URLs, a comma-separated string or a list (http(s) only; null: none, which a loop
    that builds its own client refuses). `model`: the name sent in requests (null: the first one an instance lists
    at /v1/models). `api_key`: bearer token (null: $SEAD_USER_SIM_API_KEY if set). `timeout_s`: one request;
    `max_attempts`: attempts per turn over all instances; `deadline_s`: a whole batch of turns in sync mode, one
    turn in async mode (null: no limit beyond the timeouts). `reply_retries`: re-requests of a malformed reply;
    `check_at_start`: check every instance when the loop starts; `max_error_rate` / `error_patience`: stop
    training when more than that share of a step's dialogues end in a simulator error for that many steps in a row.
    """

    SECTION_KEY = "user_sim"

    urls: Union[str, list[str], None] = None
    model: str | None = None
    api_key: str | None = field(default=None, repr=False)  # a secret: never in logs
    timeout_s: float = 60.0
    max_attempts: int = 3
    deadline_s: float | None = None
    temperature: float = 0.9
    top_p: float = 0.95
    max_tokens: int = 256
    reply_retries: int = 2
    check_at_start: bool = True
    max_error_rate: float = 0.5
    error_patience: int = 3

    def __post_init__(self) -> None:
        if isinstance(self.urls, str) and not self.urls.strip(",").strip():
            self.urls = None
        if self.urls is not None:
            try:
                self.urls = parse_urls(self.urls)
            except ValueError as exc:
                raise ConfigError(f"{config_key('urls')}: {exc}") from None
        for name in ("model", "api_key"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ConfigError(f"{config_key(name)} must be a non-empty string or null, got {value!r}")
        check_number(config_key("timeout_s"), self.timeout_s, 0.0, low_open=True)
        check_number(config_key("max_attempts"), self.max_attempts, 1)
        check_number(config_key("deadline_s"), self.deadline_s, 0.0, low_open=True, nullable=True)
        check_number(config_key("temperature"), self.temperature, 0.0)
        check_number(config_key("top_p"), self.top_p, 0.0, 1.0, low_open=True)
        check_number(config_key("max_tokens"), self.max_tokens, 1)
        check_number(config_key("reply_retries"), self.reply_retries, 0)
        check_number(config_key("max_error_rate"), self.max_error_rate, 0.0, 1.0)
        check_number(config_key("error_patience"), self.error_patience, 1)
