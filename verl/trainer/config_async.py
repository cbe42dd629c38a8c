"""Checks of ``async_training.*`` (generation overlapped with training), run at load time by ``validate_config``.

``staleness_threshold`` must be a whole number of policy versions >= 0 (NaN, inf, negatives and fractions are
refused naming the key); 0 is the synchronous trainer and needs nothing else. 1 (one-step-off) and k >= 2 (bounded
staleness, which also needs ``partial_rollout=true``; ``partial_rollout`` needs k >= 2) need what makes a stale token
trainable and what lets generation run beside training (the HF rollout, or any rollout on devices of its own);
each missing piece is a ConfigError naming the key to set (docs/off_policy.md, "Limits"). ``rollouts_in_flight``
is a whole number from 1 to k (more than 1 needs k >= 2 and no ReMax).
"""
from __future__ import annotations

import math

from verl.trainer.config_ranges import check_number
from verl.trainer.config_schema import ConfigError, PPOTrainerConfig

__all__ = ["check_async_training", "in_flight_of", "staleness_of"]

KEY = "async_training"


def staleness_of(cfg: PPOTrainerConfig) -> int:
    """The checked ``async_training.staleness_threshold`` as an int."""
    return int(cfg.async_training.staleness_threshold)


def check_in_flight(cfg: PPOTrainerConfig) -> None:
    """``rollouts_in_flight``: a whole number from 1 to ``staleness_threshold`` (more than 1 only with k >= 2),
    without ReMax (whose greedy baseline a rollout started ahead cannot generate)."""
    key, value = f"{KEY}.rollouts_in_flight", cfg.async_training.rollouts_in_flight
    check_number(key, value, 1.0)
    if value != math.floor(value):
        raise ConfigError(f"{key} counts rollouts running at once: a whole number >= 1, got {value!r}")
    if value == 1:
        return
    threshold = cfg.async_training.staleness_threshold
    if value > max(threshold, 1):
        raise ConfigError(f"{key}={value:g} runs rollouts queued ahead of the trainer at once; "
                          f"{KEY}.staleness_threshold={threshold:g} queues "
                          + ("none: set it to at least 2 (with partial_rollout=true)" if threshold < 2
                             else f"at most {threshold:g}: set {key} <= {threshold:g}"))
    if cfg.algorithm.adv_estimator == "remax":
        raise ConfigError(f"{key}={value:g}: algorithm.adv_estimator=remax generates a greedy baseline inside each "
                          f"rollout, which a rollout started ahead cannot: set {key}=1")


def in_flight_of(cfg: PPOTrainerConfig) -> int:
    """The checked ``async_training.rollouts_in_flight`` as an int."""
    return int(cfg.async_training.rollouts_in_flight)


def check_async_training(cfg: PPOTrainerConfig) -> None:
    """Raise ConfigError naming the key when ``async_training`` is out of range or cannot run with the rest."""
    value = cfg.async_training.staleness_threshold
    check_number(f"{KEY}.staleness_threshold", value, 0.0)
    if value != math.floor(value):
        raise ConfigError(f"{KEY}.staleness_threshold counts policy versions: a whole number (0 = synchronous, "
                          f"1 = one-step-off), got {value!r}")
    partial = cfg.async_training.partial_rollout
    if value >= 2 and not partial:
        raise ConfigError(f"{KEY}.staleness_threshold={value:g} keeps up to {value:g} steps' rollouts ahead of the "
                          f"trainer, whose dialogues continue across updates: set {KEY}.partial_rollout=true")
    if partial and value < 2:
        raise ConfigError(f"{KEY}.partial_rollout=true (dialogues continuing across several updates) needs "
                          f"{KEY}.staleness_threshold >= 2, got {value:g} (0 = synchronous, 1 = one-step-off)")
    check_in_flight(cfg)
    if value == 0:
        return
    setting = f"{KEY}.staleness_threshold={value:g} ({'one-step-off' if value == 1 else 'bounded staleness'})"
    rollout, correction = cfg.actor_rollout_ref.rollout, cfg.algorithm.rollout_correction
    if rollout.name != "hf" and rollout.n_gpus_per_node == 0:
        raise ConfigError(f"{setting} generates while the actor trains; the colocated vLLM engine "
                          f"(actor_rollout_ref.rollout.name={rollout.name}) sleeps during every training phase and "
                          "shares the actor's GPU memory, so it cannot: give it devices of its own "
                          "(actor_rollout_ref.rollout.n_gpus_per_node), use actor_rollout_ref.rollout.name=hf or "
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
