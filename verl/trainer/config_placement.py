"""Checks of where the policy's rollout runs (``actor_rollout_ref.rollout.n_gpus_per_node``), run at load time by
``validate_config``: 0 is the rollout on the actor's workers; N > 0 puts it on N devices of its own (split
placement, :mod:`verl.trainer.ppo.trainer_placement`): the HF rollout, or vLLM engines of
``tensor_model_parallel_size`` ranks each; anything else is a ConfigError naming the key to set.
"""
from __future__ import annotations

from verl.trainer.config_ranges import check_number
from verl.trainer.config_schema import ConfigError, PPOTrainerConfig

__all__ = ["check_placement"]

KEY = "actor_rollout_ref.rollout.n_gpus_per_node"


def check_placement(cfg: PPOTrainerConfig) -> None:
    """Raise ConfigError naming the key when the rollout's devices are out of range or cannot run with the rest."""
    rollout = cfg.actor_rollout_ref.rollout
    devices = rollout.n_gpus_per_node
    check_number(KEY, devices, 0.0)
    if devices != int(devices):
        raise ConfigError(f"{KEY} counts devices: a whole number (0 = on the actor's workers), got {devices!r}")
    if devices == 0:
        return
    tp = rollout.tensor_model_parallel_size
    if rollout.name == "vllm" and devices % tp != 0:
        raise ConfigError(f"{KEY}={devices} holds the vLLM engines of actor_rollout_ref.rollout."
                          f"tensor_model_parallel_size={tp} ranks each: make it a multiple of {tp}")
