"""The policy's rollout on devices of its own (split placement, ``actor_rollout_ref.rollout.n_gpus_per_node`` > 0):
the rollout role of :class:`~verl.workers.fsdp_workers.ActorRolloutRefWorker` on a worker group of its own, whose
weights are the actor's as of the last :meth:`StandaloneRolloutWorker.load_rollout_weights`.

The group is one HF-generate replica sharded (FSDP) over its ranks; it generates while the actor's group trains.
The trainer installs the actor's weights after each update (:mod:`verl.trainer.ppo.trainer_placement`); the
install is one call on the group, so it runs between two generation calls: a turn being generated finishes on the
old weights, and every generation reports the version it was sampled with.
"""
from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from verl.single_controller.base import Dispatch, register
from verl.workers.fsdp_workers import ActorRolloutRefWorker
from verl.workers.rollout.standalone_weights import install_full_weights

__all__ = ["StandaloneRolloutWorker"]


class StandaloneRolloutWorker(ActorRolloutRefWorker):
    """The rollout role alone; ``config`` is ``cfg.actor_rollout_ref``. Its policy version is the one installed."""

    def __init__(self, config: DictConfig) -> None:
        super().__init__(config, role="rollout")
        self.installed_version = 0  # the model's own weights until the first install

    def _policy_version(self) -> int:
        return self.installed_version

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_rollout_weights(self, weights: dict[str, Any], version: int) -> int:
        """Install the actor's full weights (:meth:`ActorRolloutRefWorker.export_rollout_weights`; Ray resolves
        the reference) as policy ``version``; returns how many tensors were copied."""
        self._require(self._is_rollout, "load_rollout_weights", "rollout")
        with self.actor_offload.on_device():
            copied = install_full_weights(self._module, weights)
        self.installed_version = int(version)
        return copied
