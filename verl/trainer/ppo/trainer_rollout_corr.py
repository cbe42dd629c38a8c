"""The trainer's side of rollout correction (``algorithm.rollout_correction``), called by RayPPOTrainer.train_step.

Decoupled mode (default): after the old-log-prob pass, a batch that carries the rollout engine's
``rollout_log_probs`` gets the mismatch per agent-turn index (``rollout/kl_k3_turn_{k}``, ...) and the
``rollout_corr/*`` metrics, and, when configured, ``rollout_is_weights`` (used by the actor's loss) and the
rejection mask, which the advantage step applies after the advantages (:mod:`verl.trainer.ppo.rollout_rejection`:
credit on the dialogue as sampled, then the rejected tokens leave the loss).
Bypass mode: the rollout's log-probs become ``old_log_probs``, the old-log-prob pass is skipped, and the actor
computes weights, rejection and metrics against its current policy in the ``bypass_mode`` policy loss (the
trainer passes it ``actor.policy_loss`` at start).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

import torch

from verl.protocol import DataProto
from verl.trainer.config_schema import RolloutCorrectionConfig
from verl.trainer.ppo.rollout_corr_helper import rollout_correction_for_batch
from verl.utils.agent_turns import agent_turn_ids
from verl.workers.rollout.logprob_mismatch import logprob_mismatch_by_turn

logger = logging.getLogger(__name__)

__all__ = ["actor_policy_loss", "check_rollout_log_probs", "correct_batch"]


def actor_policy_loss(config: RolloutCorrectionConfig) -> Optional[dict[str, Any]]:
    """``actor_rollout_ref.actor.policy_loss`` for the workers in bypass mode (veRL's ``loss_mode=bypass_mode`` and
    its ``rollout_correction`` settings); None otherwise (the actor's vanilla PPO loss)."""
    if not config.bypass_mode:
        return None
    return {"loss_mode": "bypass_mode", "rollout_correction": dataclasses.asdict(config)}


def check_rollout_log_probs(batch: DataProto, config: RolloutCorrectionConfig) -> None:
    """Raise naming the keys when correction is on but the rollout returned no ``rollout_log_probs``."""
    if config.enabled and "rollout_log_probs" not in batch.batch.keys():
        raise ValueError(
            "algorithm.rollout_correction is on (rollout_is, rollout_rs or bypass_mode) but the rollout returned no "
            "rollout_log_probs: set actor_rollout_ref.rollout.calculate_log_probs=true, and use a rollout (loop) "
            f"that returns the engine's log-probs; the batch has {sorted(batch.batch.keys())}")


def correct_batch(batch: DataProto, config: RolloutCorrectionConfig) -> tuple[dict[str, float], Optional[torch.Tensor]]:
    """Decoupled mode on a batch with ``old_log_probs`` and ``rollout_log_probs``: the per-turn mismatch, then
    the weights (added to the batch) and the rejection as configured; returns ``(metrics, kept)``, ``kept`` the
    response mask after rejection for :func:`~verl.trainer.ppo.rollout_rejection.credit_then_reject` (None when
    nothing is rejected by configuration or the batch has no loss token)."""
    mask = batch.batch["response_mask"]
    if not bool(mask.any()):
        logger.warning("rollout correction: the batch has no loss-carrying token; nothing to correct")
        return {}, None
    metrics = logprob_mismatch_by_turn(batch.batch["rollout_log_probs"], batch.batch["old_log_probs"],
                                       agent_turn_ids(batch.batch))
    kept, corr_metrics = rollout_correction_for_batch(batch, config)
    metrics.update(corr_metrics)
    return metrics, kept
