"""Split placement: the policy's rollout on devices of its own (``actor_rollout_ref.rollout.n_gpus_per_node`` > 0),
veRL's and AReaL's layout for generating while the actor trains.

:class:`StandaloneRollout` starts a :class:`~verl.workers.rollout_worker.StandaloneRolloutWorker` group on a
resource pool of its own and hands the rollout loops its engine. :meth:`StandaloneRollout.sync` gives it the
actor's weights: the actor's ranks gather them (rank 0 keeps the full tensors and puts them once in Ray's object
store, where every rollout rank reads them) and the rollout group installs them with their version; a LoRA actor
sends its frozen base once and then only its adapter (unless ``model.lora.merge``: merged weights). The trainer
syncs after each actor update and once at the start (the loaded checkpoint's weights); a rollout running meanwhile
(one-step-off, bounded staleness) gets them between two of its generation calls, while the trainer goes on (it
waits for an install only at the next sync). docs/off_policy.md, "Split placement".
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from omegaconf import DictConfig

from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.trainer.config_schema import PPOTrainerConfig
from verl.workers.rollout.replicas import WorkerGroupEngine

logger = logging.getLogger(__name__)

__all__ = ["StandaloneRollout", "standalone_rollout"]


class StandaloneRollout:
    """The rollout's worker group on ``devices`` slots of its own (GPUs with ``use_gpu``, else CPU processes);
    ``config`` is ``actor_rollout_ref``. ``engine`` is what the rollout loops generate with."""

    def __init__(self, config: DictConfig, devices: int, use_gpu: bool) -> None:
        from verl.workers.rollout_worker import StandaloneRolloutWorker

        self.pool = RayResourcePool([devices], use_gpu=use_gpu, name_prefix=f"rollout_{uuid.uuid4().hex[:6]}")
        try:
            self.worker_group = RayWorkerGroup(self.pool, RayClassWithInitArgs(StandaloneRolloutWorker, config=config),
                                               name_prefix="rollout")
            self.worker_group.init_model()
        except BaseException:
            self.pool.remove()
            raise
        self.engine = WorkerGroupEngine(self.worker_group)
        self.base_installed = False  # a LoRA actor's frozen base: sent once, then its adapter alone
        self._installing: list[Any] | None = None  # the install in progress (its object refs)

    def sync(self, actor_worker_group: Any) -> dict[str, float]:
        """Export the actor's current weights and start their install in the rollout group, which runs it between
        two of its generation calls: every generation call sent after this one returns runs on them. The first sync
        waits for its install (before it the engine may hold dummy weights; a payload that does not fit fails
        here); a later one waits only for the previous install, not for the generation call in progress.

        Metrics: ``timing_s/weight_sync`` (what the trainer waited: the previous install, the export, the
        submission), ``rollout/weight_install_s`` (the last finished install on the slowest rollout rank),
        ``rollout/weight_sync_*`` (what the gather moved), ``rollout/standalone_policy_version`` (the version
        sent)."""
        start = time.perf_counter()
        metrics = self.wait_installed()
        weights, version, exported = actor_worker_group.export_rollout_weights(send_base=not self.base_installed)[0]
        self._installing = self.worker_group.execute_all_async("load_rollout_weights", weights, version)
        if not self.base_installed:
            metrics = self.wait_installed()
            self.base_installed = True
        metrics.update(exported)
        metrics.update({"timing_s/weight_sync": time.perf_counter() - start,
                        "rollout/standalone_policy_version": float(version)})
        logger.info("sent version %d to the standalone rollout; the trainer waited %.3f s", version,
                    metrics["timing_s/weight_sync"])
        return metrics

    def wait_installed(self) -> dict[str, float]:
        """Wait for the install in progress, if any; its time on the slowest rollout rank
        (``rollout/weight_install_s``)."""
        if self._installing is None:
            return {}
        handles, self._installing = self._installing, None
        return {"rollout/weight_install_s": max(self.worker_group.wait_all("load_rollout_weights", handles))}

    def shutdown(self) -> None:
        """Stop the rollout group and give its devices back (idempotent)."""
        self.worker_group.shutdown()
        self.pool.remove()


def standalone_rollout(typed: PPOTrainerConfig, config: DictConfig, use_gpu: bool) -> StandaloneRollout | None:
    """The rollout on devices of its own when the checked config ``typed`` asks for them (``config``:
    ``actor_rollout_ref``); None when it runs on the actor's workers."""
    devices = typed.actor_rollout_ref.rollout.n_gpus_per_node
    return StandaloneRollout(config, devices, use_gpu) if devices > 0 else None
