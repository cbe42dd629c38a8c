"""Entry point of PPO/GRPO training: ``python -m verl.trainer.main_ppo key=value ...`` (Hydra overrides).

Validates the config, starts a local Ray instance if none is running (``ray.init(address="local",
num_cpus=max(8, needed), include_dashboard=False)``; with ``RAY_ADDRESS`` set or ``trainer.nnodes > 1`` it joins
the running cluster instead), places the actor/rollout(/reference) worker group and, for GAE, the critic group
on one resource pool of ``nnodes x n_gpus_per_node`` slots (CPU slots on CPU, GPU slots on CUDA), and runs
``RayPPOTrainer.fit()``.
Hydra writes no ``outputs/<date>`` directory and does not chdir (see the ``hydra`` section of the YAML). Ray,
torch and the workers are imported only once the config is valid, so a config error is reported in about a second.

``preset=NAME`` (verl/trainer/config/preset/NAME.yaml: cpu, gpu, gpu_lora, rehearsal) puts a preset's keys under the
other key=value arguments; ``--dry-run`` prints every value the preset or the command line set, with where it came
from, and exits.

Example (CPU, built-in task)::

    python -m verl.tasks.repeat_letter --out_dir outputs/data/repeat_letter
    python -m verl.trainer.main_ppo actor_rollout_ref.model.path=outputs/tiny_model \\
        data.train_files=outputs/data/repeat_letter/train.parquet algorithm.adv_estimator=grpo \\
        actor_rollout_ref.rollout.n=4 trainer.n_gpus_per_node=2
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any

import hydra
from omegaconf import DictConfig

from verl.trainer.cli_overrides import check_overrides
from verl.trainer.config_schema import ConfigError, PPOTrainerConfig
from verl.trainer.config_validation import load_config
from verl.utils.logging_setup import configure_logging

logger = logging.getLogger(__name__)


def resolve_device(typed: PPOTrainerConfig) -> str:
    """``trainer.device`` with auto resolved: cuda when available, else cpu; cuda without a GPU is an error."""
    import torch

    device = typed.trainer.device
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is available (use trainer.device=auto or cpu)")
    return device


def ray_cpus(typed: PPOTrainerConfig) -> int:
    """Logical CPUs for ray.init: ``trainer.ray_num_cpus``, else max(8, workers + 4) (the rollout's own count)."""
    return typed.trainer.ray_num_cpus or max(8, typed.world_size + typed.actor_rollout_ref.rollout.n_gpus_per_node
                                              + 4)


def run_ppo(config: DictConfig) -> dict[str, Any]:
    """Validate ``config``, set up Ray and the worker groups, train, tear down; return the last step's metrics."""
    typed = load_config(config)
    device = resolve_device(typed)
    import ray

    from verl.single_controller.ray import RayResourcePool
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, Role
    from verl.utils.dataset import load_tokenizer

    started_ray = False
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS") or typed.trainer.nnodes > 1:
            ray.init(address=os.environ.get("RAY_ADDRESS", "auto"),  # join the running (multi-node) cluster
                     logging_level=logging.WARNING)
        else:
            ray.init(address="local", num_cpus=ray_cpus(typed), include_dashboard=False,
                     logging_level=logging.WARNING)
        started_ray = True
    from verl.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker

    try:
        model = typed.actor_rollout_ref.model
        tokenizer = load_tokenizer(model.tokenizer_path or model.path)
        pool = RayResourcePool([typed.trainer.n_gpus_per_node] * typed.trainer.nnodes, use_gpu=device == "cuda",
                               max_colocate_count=2 if typed.need_critic else 1, name_prefix="ppo")
        trainer = RayPPOTrainer(config, tokenizer,
                                {Role.ActorRollout: ActorRolloutRefWorker, Role.Critic: CriticWorker}, pool)
        try:
            trainer.check_resume_model()
            trainer.init_workers()
            return trainer.fit()
        finally:
            trainer.shutdown()
            pool.remove()
    finally:
        if started_ray:
            ray.shutdown()


@hydra.main(config_path="config", config_name="ppo_trainer", version_base=None)
def main(config: DictConfig) -> None:
    """Hydra entry point."""
    configure_logging()
    try:
        run_ppo(config)
    except ConfigError as exc:
        raise SystemExit(f"config error: {exc}") from None


if __name__ == "__main__":
    try:
        if "--dry-run" in sys.argv[1:]:  # every value a preset or the command line set, with its origin; no run
            from verl.trainer.launch_settings import describe

            print(describe([a for a in sys.argv[1:] if a != "--dry-run"]))
            raise SystemExit(0)
        sys.argv[1:] = check_overrides(sys.argv[1:])
    except ConfigError as exc:
        raise SystemExit(f"config error: {exc}") from None
    main()
