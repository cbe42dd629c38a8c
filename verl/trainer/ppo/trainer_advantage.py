"""The driver's advantage step of a training step: rollout correction (decoupled mode), then the advantage
estimator and the diagnosis reweighting on the dialogue as sampled, then the rejection
(:mod:`verl.trainer.ppo.rollout_rejection`), on a batch that holds its rewards, log-probs and (for a critic)
values."""
from __future__ import annotations

from typing import Any, Optional

from verl.protocol import DataProto
from verl.trainer.config_schema import AlgorithmConfig
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.diagnosis_reweight import reweight_advantages
from verl.trainer.ppo.estimator_inputs import estimator_inputs
from verl.trainer.ppo.rollout_rejection import credit_then_reject
from verl.trainer.ppo.trainer_rollout import compute_response_mask
from verl.trainer.ppo.trainer_rollout_corr import correct_batch

__all__ = ["advantage_step", "assign_credit", "compute_advantage"]


def compute_advantage(data: DataProto, adv_estimator: str, gamma: float = 1.0, lam: float = 1.0,
                      num_repeat: int = 1, norm_adv_by_std_in_grpo: bool = True,
                      config: Optional[Any] = None) -> DataProto:
    """Add ``advantages`` and ``returns`` (bs, R) computed on the driver by the named estimator.

    GAE uses ``values``; group estimators group rows by ``non_tensor_batch['uid']``; ReMax uses
    ``reward_baselines``; a registered estimator also gets the inputs it names among
    :data:`~verl.trainer.ppo.estimator_inputs.OPTIONAL_INPUTS` (``values``, ``agent_turn_ids``, ``turn_scores``,
    ``gamma``, ``lam``, ``norm_adv_by_std_in_grpo``). ``num_repeat`` (rollout.n) is accepted for veRL compatibility.
    """
    if "response_mask" not in data.batch.keys():
        data.batch["response_mask"] = compute_response_mask(data)
    rewards, mask = data.batch["token_level_rewards"], data.batch["response_mask"]
    if adv_estimator == "gae":
        advantages, returns = core_algos.compute_gae_advantage_return(rewards, data.batch["values"], mask, gamma, lam)
    elif adv_estimator == "grpo":
        advantages, returns = core_algos.compute_grpo_outcome_advantage(
            rewards, mask, index=data.non_tensor_batch["uid"], norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)
    else:
        fn = core_algos.get_adv_estimator_fn(adv_estimator)
        kwargs: dict[str, Any] = {"token_level_rewards": rewards, "response_mask": mask,
                                  "config": config if config is not None else {"gamma": gamma, "lam": lam}}
        if "uid" in data.non_tensor_batch:
            kwargs["index"] = data.non_tensor_batch["uid"]
        if "reward_baselines" in data.batch.keys():
            kwargs["reward_baselines"] = data.batch["reward_baselines"]
        kwargs.update(estimator_inputs(fn, data, {"gamma": gamma, "lam": lam,
                                                  "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo}))
        advantages, returns = fn(**kwargs)
    data.batch["advantages"], data.batch["returns"] = advantages, returns
    return data


def assign_credit(batch: DataProto, algorithm: AlgorithmConfig, num_repeat: int = 1) -> dict[str, float]:
    """Advantages and returns by ``algorithm.adv_estimator``, then the diagnosis reweighting when enabled, in place;
    returns the reweighting's metrics."""
    compute_advantage(batch, algorithm.adv_estimator, algorithm.gamma, algorithm.lam, num_repeat=num_repeat,
                      norm_adv_by_std_in_grpo=algorithm.norm_adv_by_std_in_grpo, config=algorithm)
    diagnosis = algorithm.diagnosis_reweight
    if not diagnosis.enable:
        return {}
    return reweight_advantages(batch, diagnosis.weights, diagnosis.apply_to)


def advantage_step(batch: DataProto, algorithm: AlgorithmConfig, num_repeat: int = 1) -> dict[str, float]:
    """Rollout correction (when the batch has ``rollout_log_probs``: weights, metrics, the rejection mask), then
    :func:`assign_credit` and the rejection by the rule of :mod:`verl.trainer.ppo.rollout_rejection`, in place on
    ``batch`` (with ``token_level_rewards``); returns the metrics."""
    metrics: dict[str, float] = {}
    kept = None
    if "rollout_log_probs" in batch.batch.keys():  # decoupled mode
        corr_metrics, kept = correct_batch(batch, algorithm.rollout_correction)
        metrics.update(corr_metrics)
    metrics.update(credit_then_reject(batch, kept, lambda b: assign_credit(b, algorithm, num_repeat)))
    return metrics
