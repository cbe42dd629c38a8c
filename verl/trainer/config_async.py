"""Checks of ``async_training.*`` (generation overlapped with training), run at load time by ``validate_config``.

``staleness_threshold`` must be a whole number of policy versions >= 0 (NaN, inf, negatives and fractions are
refused naming the key); 0 is the synchronous trainer and needs nothing else. 1 (one-step-off) needs what makes a
stale token trainable and what lets generation run beside training; each missing piece is a ConfigError naming the
key to set (docs/off_policy.md, "Limits").
"""
from __future__ import annotations

import math

from verl.trainer.config_ranges import check_number
from verl.trainer.config_schema import ConfigError, PPOTrainerConfig

__all__ = ["MAX_STALENESS", "check_async_training", "staleness_of"]

KEY = "async_training"
MAX_STALENESS = 1  # what is built: one-step-off; >= 2 needs partial dialogues (issue 37, phase 2)


def staleness_of(cfg: PPOTrainerConfig) -> int:
    """The checked ``async_training.staleness_threshold`` as an int."""
    return int(cfg.async_training.staleness_threshold)


def check_async_training(cfg: PPOTrainerConfig) -> None:
    """Raise ConfigError naming the key when ``async_training`` is out of range or cannot run with the rest."""
    value = cfg.async_training.staleness_threshold
    check_number(f"{KEY}.staleness_threshold", value, 0.0)
    if value != math.floor(value):
        raise ConfigError(f"{KEY}.staleness_threshold counts policy versions: a whole number (0 = synchronous, "
                          f"1 = one-step-off), got {value!r}")
    if cfg.async_training.partial_rollout:
        raise ConfigError(f"{KEY}.partial_rollout=true (dialogues continuing across updates) is not built yet; "
                          "set it to false")
    if value > MAX_STALENESS:
        raise ConfigError(f"{KEY}.staleness_threshold={value:g}: values above {MAX_STALENESS} need partial "
                          f"dialogues, which are not built yet; use 0 (synchronous) or 1 (one-step-off)")
    if value == 0:
        return
    setting = f"{KEY}.staleness_threshold={value:g} (one-step-off)"
    rollout, correction = cfg.actor_rollout_ref.rollout, cfg.algorithm.rollout_correction
    if rollout.name != "hf":
        raise ConfigError(f"{setting} generates while the actor trains; the colocated vLLM engine "
                          f"(actor_rollout_ref.rollout.name={rollout.name}) sleeps during every training phase and "
                          "shares the actor's GPU memory, so it cannot: use actor_rollout_ref.rollout.name=hf or "
                          "staleness_threshold=0")
    if not rollout.calculate_log_probs:
        raise ConfigError(f"{setting} trains on tokens sampled by an older policy and needs the behaviour "
                          "log-prob of each: set actor_rollout_ref.rollout.calculate_log_probs=true")
    if correction.rollout_is is None and not correction.bypass_mode:
        raise ConfigError(f"{setting} trains on tokens sampled by an older policy: correct them with "
                          "algorithm.rollout_correction.rollout_is=token|turn|sequence (decoupled PPO) or "
                          "algorithm.rollout_correction.bypass_mode=true")
    if cfg.algorithm.filter_groups.enable:
        raise ConfigError(f"{setting}: algorithm.filter_groups.enable draws further prompt batches inside a "
                          "step's rollout, which would race the next step's rollout for the data loader; turn one "
                          "of them off")
