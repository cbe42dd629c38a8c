"""KL between the policy and the reference: per-token estimators, the KL-coefficient controllers and the in-reward
penalty (``apply_kl_penalty``, re-exported by :mod:`verl.trainer.ppo.ray_trainer` as in veRL).

veRL keeps these in ``verl.trainer.ppo.core_algos``; they are re-exported there, so ``core_algos.kl_penalty``,
``core_algos.FixedKLController`` etc. work as in veRL. The estimators are used twice: as the in-reward penalty
(``algorithm.use_kl_in_reward``, with ``algorithm.kl_penalty`` and a controller from ``algorithm.kl_ctrl``)
and as the actor's KL loss (``actor.use_kl_loss`` with ``actor.kl_loss_type``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from verl.utils.torch_functional import masked_mean

logger = logging.getLogger(__name__)

KL_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def kl_penalty_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference (value only; see :func:`kl_penalty`).

    ``kl``/``k1``: lp - ref. ``abs``: |lp - ref|. ``mse``/``k2``: (lp - ref)^2 / 2. ``low_var_kl``/``k3``:
    exp(ref - lp) - (ref - lp) - 1 with ref - lp clamped to [-20, 20] and the result to [-10, 10]. A trailing
    ``+`` is accepted and ignored here.
    """
    if logprob.shape != ref_logprob.shape:
        raise ValueError(
            f"kl_penalty: logprob {tuple(logprob.shape)} and ref_logprob {tuple(ref_logprob.shape)} differ in shape"
        )
    name = kl_penalty[:-1] if kl_penalty.endswith("+") else kl_penalty
    if name in ("kl", "k1"):
        return logprob - ref_logprob
    if name == "abs":
        return (logprob - ref_logprob).abs()
    if name in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if name in ("low_var_kl", "k3"):
        log_ratio = torch.clamp(ref_logprob - logprob, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10.0, max=10.0)
    if name == "full":
        raise NotImplementedError("kl_penalty 'full' needs the full vocabulary distributions and is not supported")
    raise ValueError(f"unknown kl_penalty {kl_penalty!r}; expected one of {list(KL_ESTIMATORS)}, optionally with '+'")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate (see :func:`kl_penalty_forward`); a ``+`` suffix (e.g. ``k3+``) keeps the named
    estimator's value but backpropagates the gradient of k2, whose expected gradient is the true KL gradient."""
    forward = kl_penalty_forward(logprob, ref_logprob, kl_penalty)
    if not kl_penalty.endswith("+"):
        return forward
    k2 = 0.5 * (logprob - ref_logprob).square()
    return k2 - k2.detach() + forward.detach()


class FixedKLController:
    """A constant KL coefficient (``.value``); ``update`` does nothing."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Keep the coefficient unchanged."""


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019): steers the measured KL towards ``target_kl``.

    Each update multiplies ``.value`` by 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if target_kl <= 0:
            raise ValueError(f"AdaptiveKLController target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"AdaptiveKLController horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient after ``n_steps`` samples (veRL passes the batch size) with mean KL ``current_kl``."""
        proportional_error = float(np.clip(current_kl / self.target - 1, -0.2, 0.2))
        self.value *= 1 + proportional_error * n_steps / self.horizon
        logger.debug("adaptive KL coefficient -> %.6g (kl %.6g, target %.6g)", self.value, current_kl, self.target)


def _as_mapping(config: Any) -> Mapping[str, Any]:
    """``config`` as a read-only mapping: a dict/DictConfig as is, an attribute object (dataclass) by its fields."""
    if isinstance(config, Mapping):
        return config
    if config is not None and hasattr(config, "__dict__"):
        return vars(config)
    raise TypeError(f"algorithm.kl_ctrl must be a mapping or a config object, got {type(config).__name__}")


def get_kl_controller(kl_ctrl_config: Any) -> FixedKLController | AdaptiveKLController:
    """Build the controller described by ``algorithm.kl_ctrl`` (keys: type fixed|adaptive, kl_coef, and for
    adaptive target_kl and horizon)."""
    cfg = _as_mapping(kl_ctrl_config)
    ctrl_type, kl_coef = cfg.get("type"), cfg.get("kl_coef")
    if kl_coef is None:
        raise ValueError("algorithm.kl_ctrl.kl_coef is required")
    if ctrl_type == "fixed":
        return FixedKLController(kl_coef=kl_coef)
    if ctrl_type == "adaptive":
        target_kl, horizon = cfg.get("target_kl"), cfg.get("horizon")
        if target_kl is None or horizon is None:
            raise ValueError("algorithm.kl_ctrl.type=adaptive needs target_kl and horizon")
        return AdaptiveKLController(init_kl_coef=kl_coef, target_kl=target_kl, horizon=horizon)
    raise ValueError(f"unknown algorithm.kl_ctrl.type {ctrl_type!r}; expected 'fixed' or 'adaptive'")


def apply_kl_penalty(data: Any, kl_ctrl: Any, kl_penalty: str = "kl") -> tuple[Any, dict[str, float]]:
    """The in-reward KL penalty of a DataProto batch (veRL's, in its ``ray_trainer``): ``token_level_rewards =
    token_level_scores - beta * KL(old || ref) * mask`` with the ``kl_penalty`` estimator's value; updates the
    controller."""
    mask = data.batch["response_mask"]
    kld = kl_penalty_forward(data.batch["old_log_probs"], data.batch["ref_log_prob"], kl_penalty) * mask
    beta = kl_ctrl.value
    data.batch["token_level_rewards"] = data.batch["token_level_scores"] - beta * kld
    current_kl = float(masked_mean(kld, mask, axis=-1).mean())
    kl_ctrl.update(current_kl=current_kl, n_steps=len(data))
    return data, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
