"""Range checks of the trainer config's numeric and path values, run at load time by ``validate_config``.

Types are checked when the config is built (:mod:`verl.trainer.config_validation`); this module rejects values of
the right type that cannot work (``lr=inf``/``nan``/negative, ``temperature<0``, ``top_p`` outside (0, 1],
``gamma>1``, one-element ``betas``, ...), each as a :class:`ConfigError` naming the full key, instead of a
failure steps later ("probability tensor contains inf/nan").
"""
from __future__ import annotations

import math
from typing import Any, Optional

from verl.trainer.config_schema import DIAGNOSIS_WEIGHT_MAX, AlgorithmConfig, ConfigError, OptimConfig, PPOTrainerConfig


def check_number(key: str, value: Any, low: Optional[float] = None, high: Optional[float] = None,
                 low_open: bool = False, high_open: bool = False, nullable: bool = False,
                 allow_inf: bool = False) -> None:
    """Raise ConfigError naming `key` unless `value` is a number in the interval, finite unless `allow_inf`, never
    NaN (or null if `nullable`). The one range check of every config section, engine and plug-ins alike."""
    if value is None and nullable:
        return
    finite = isinstance(value, (int, float)) and (math.isfinite(value) or (allow_inf and not math.isnan(value)))
    if isinstance(value, bool) or not finite:
        kind = "a number (not NaN)" if allow_inf else "a finite number"
        raise ConfigError(f"{key} must be {kind}{' or null' if nullable else ''}, got {value!r}")
    too_low = low is not None and (value < low or (low_open and value == low))
    too_high = high is not None and (value > high or (high_open and value == high))
    if too_low or too_high:
        left = "-inf" if low is None else f"{low:g}"
        right = "inf" if high is None else f"{high:g}"
        interval = f"{'(' if low_open or low is None else '['}{left}, {right}{')' if high_open or high is None else ']'}"
        raise ConfigError(f"{key}={value!r} is outside {interval}")


def _check_optim(prefix: str, optim: OptimConfig) -> None:
    check_number(f"{prefix}.lr", optim.lr, 0.0)
    check_number(f"{prefix}.weight_decay", optim.weight_decay, 0.0)
    if len(optim.betas) != 2:
        raise ConfigError(f"{prefix}.betas must be two numbers [beta1, beta2], got {optim.betas!r}")
    for i, beta in enumerate(optim.betas):
        check_number(f"{prefix}.betas[{i}]", beta, 0.0, 1.0, high_open=True)
    check_number(f"{prefix}.lr_warmup_steps_ratio", optim.lr_warmup_steps_ratio, 0.0, 1.0)
    check_number(f"{prefix}.min_lr_ratio", optim.min_lr_ratio, 0.0, 1.0)


def _check_sampling(prefix: str, temperature: float, top_p: float, top_k: int) -> None:
    check_number(f"{prefix}.temperature", temperature, 0.0)
    check_number(f"{prefix}.top_p", top_p, 0.0, 1.0, low_open=True)
    if top_k < -1:
        raise ConfigError(f"{prefix}.top_k must be -1 (off) or >= 0, got {top_k}")


def _check_turn_credit(algo: AlgorithmConfig) -> None:
    """The turn-level estimator's weight and the diagnosis reweighting's label weights."""
    check_number("algorithm.turn_mixed.turn_weight", algo.turn_mixed.turn_weight, 0.0)
    diagnosis, key = algo.diagnosis_reweight, "algorithm.diagnosis_reweight"
    for label, weight in diagnosis.weights.items():
        if not isinstance(label, str) or not label.strip():
            raise ConfigError(f"{key}.weights: labels must be non-empty strings, got {label!r}")
        check_number(f"{key}.weights.{label}", weight, 0.0, DIAGNOSIS_WEIGHT_MAX)
    if diagnosis.enable and not diagnosis.weights:
        raise ConfigError(f"{key}.enable=true needs at least one label weight, e.g. "
                          f"+{key}.weights.false_claim=1.5")


def check_ranges(cfg: PPOTrainerConfig) -> None:
    """Raise ConfigError naming the first key whose value is out of its range (see the module docstring)."""
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    _check_optim("actor_rollout_ref.actor.optim", actor.optim)
    _check_optim("critic.optim", cfg.critic.optim)
    a = "actor_rollout_ref.actor"
    check_number(f"{a}.clip_ratio", actor.clip_ratio, 0.0, low_open=True)
    check_number(f"{a}.clip_ratio_low", actor.clip_ratio_low, 0.0, nullable=True)
    check_number(f"{a}.clip_ratio_high", actor.clip_ratio_high, 0.0, nullable=True)
    check_number(f"{a}.clip_ratio_c", actor.clip_ratio_c, 1.0, low_open=True)
    check_number(f"{a}.entropy_coeff", actor.entropy_coeff)
    check_number(f"{a}.kl_loss_coef", actor.kl_loss_coef, 0.0)
    check_number(f"{a}.grad_clip", actor.grad_clip, 0.0, low_open=True)
    check_number("critic.cliprange_value", cfg.critic.cliprange_value, 0.0, low_open=True)
    check_number("critic.grad_clip", cfg.critic.grad_clip, 0.0, low_open=True)
    _check_sampling("actor_rollout_ref.rollout", rollout.temperature, rollout.top_p, rollout.top_k)
    val = rollout.val_kwargs
    _check_sampling("actor_rollout_ref.rollout.val_kwargs", val.temperature, val.top_p, val.top_k)
    algo = cfg.algorithm
    check_number("algorithm.gamma", algo.gamma, 0.0, 1.0)
    check_number("algorithm.lam", algo.lam, 0.0, 1.0)
    check_number("algorithm.kl_ctrl.kl_coef", algo.kl_ctrl.kl_coef, 0.0)
    check_number("algorithm.kl_ctrl.target_kl", algo.kl_ctrl.target_kl, 0.0, low_open=True)
    if algo.kl_ctrl.horizon <= 0:
        raise ConfigError(f"algorithm.kl_ctrl.horizon must be positive, got {algo.kl_ctrl.horizon}")
    _check_turn_credit(algo)
    trainer = cfg.trainer
    if trainer.ray_num_cpus is not None and trainer.ray_num_cpus < 0:
        raise ConfigError(f"trainer.ray_num_cpus must be >= 0 or null, got {trainer.ray_num_cpus}")
    if trainer.critic_warmup < 0:
        raise ConfigError(f"trainer.critic_warmup must be >= 0, got {trainer.critic_warmup}")
    for key in ("default_local_dir", "log_dir"):
        if not getattr(trainer, key).strip():
            raise ConfigError(f"trainer.{key} must be a non-empty path")
