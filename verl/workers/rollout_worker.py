"""The policy's rollout on devices of its own (split placement, ``actor_rollout_ref.rollout.n_gpus_per_node`` > 0):
the rollout role of :class:`~verl.workers.fsdp_workers.ActorRolloutRefWorker` on a worker group of its own, whose
weights are the actor's as of the last :meth:`StandaloneRolloutWorker.load_rollout_weights`.

``rollout.name=hf``: one HF-generate replica sharded (FSDP) over the group's ranks, starting from the model's own
weights. ``rollout.name=vllm``: a vLLM engine per tensor-parallel group (each a replica), no training copy of the
model beside it, never put to sleep (nothing else uses its devices), holding dummy weights until the first
install. A LoRA actor's rollout carries the same adapter (a PEFT model, or an engine serving it) and receives the
frozen base once, then the adapter alone; with ``model.lora.merge`` it is a plain model given merged weights.
The trainer installs the actor's weights at the start and after each update
(:mod:`verl.trainer.ppo.trainer_placement`); the install is one call on the group, so it runs between two
generation calls: a turn being generated finishes on the old weights, and every generation reports the version it
was sampled with. A checkpoint keeps each rank's RNG states (:meth:`StandaloneRolloutWorker.save_rollout_state`),
so a resumed run samples what the uninterrupted one would have.
"""
from __future__ import annotations

import json
import logging
import os
import time

import torch
from omegaconf import DictConfig

from verl.single_controller.base import Dispatch, register
from verl.utils.checkpoint import check_rng_state, get_rng_state, set_rng_state
from verl.utils.lora import LoraSettings
from verl.utils.shm_model import model_dir
from verl.workers.fsdp_models import model_seed
from verl.workers.fsdp_workers import ActorRolloutRefWorker
from verl.workers.rollout.standalone_weights import RolloutWeights, install_rollout_weights
from verl.workers.worker_inputs import load_worker_tokenizer

logger = logging.getLogger(__name__)

__all__ = ["StandaloneRolloutWorker", "rng_file"]


def rng_file(rank: int) -> str:
    """The name of rollout rank ``rank``'s RNG states in a checkpoint's ``rollout/``."""
    return f"rng_rank_{rank}.json"


class StandaloneRolloutWorker(ActorRolloutRefWorker):
    """The rollout role alone; ``config`` is ``cfg.actor_rollout_ref``. Its policy version is the one installed."""

    hybrid_rollout = False

    def __init__(self, config: DictConfig) -> None:
        super().__init__(config, role="rollout")
        lora = LoraSettings.from_model_config(self.config.model, "actor_rollout_ref.model")
        self.lora = None if lora is None or lora.merge else lora  # merged: a plain model given merged weights
        self.installed_version = 0  # the model's own weights (HF) until the first install

    def _policy_version(self) -> int:
        return self.installed_version

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """HF: the sharded model and its generate (the rollout role's). vLLM: the process group and the engine."""
        if self.rollout_name == "hf":
            super().init_model()
            return
        cfg = self.config
        self.init_distributed(timeout_s=float(cfg.get("nccl_timeout", 600)))
        model_path = model_dir(cfg.model.path, bool(cfg.model.get("use_shm", False)))
        self.tokenizer = load_worker_tokenizer(cfg.model, model_path)
        self.rollout = self._build_vllm_engine(model_path)
        torch.manual_seed(model_seed(cfg.actor) + self.rank)

    def _refresh_rollout_weights(self) -> None:
        """Nothing to refresh (the engine never sleeps here); generating before the first install is an error."""
        if self.rollout_name == "vllm" and not self.rollout.base_loaded:
            raise RuntimeError("the standalone vLLM rollout holds dummy weights until the trainer installs the actor's "
                               "(StandaloneRollout.sync); generate after it")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_rollout_weights(self, weights: RolloutWeights, version: int) -> float:
        """Install what the actor exported (:meth:`ActorRolloutRefWorker.export_rollout_weights`; Ray resolves the
        reference) as policy ``version``: full weights, or a LoRA actor's adapter (and its base while this rollout
        lacks it); returns the seconds the install took."""
        self._require(self._is_rollout, "load_rollout_weights", "rollout")
        start = time.perf_counter()
        if self.rollout_name == "vllm":
            copied = self._install_in_engine(weights)
        else:
            with self.actor_offload.on_device():
                copied = install_rollout_weights(self._module, weights)
        self.installed_version = int(version)
        seconds = time.perf_counter() - start
        logger.info("rank %d: installed %d tensors of version %d in %.3f s", self.rank, copied, version, seconds)
        return seconds

    def _install_in_engine(self, weights: RolloutWeights) -> int:
        """Load ``weights`` into the vLLM engine: the model's weights (or base) when sent, then the adapter."""
        from verl.workers.rollout.vllm_rollout import WeightSyncStats

        if (weights.adapter is not None) != self.rollout.serves_adapter:
            raise ValueError("the actor's weights do not fit this engine: "
                             + ("an adapter for an engine that serves none" if weights.adapter is not None
                                else "no adapter for an engine that serves the actor's"))
        copied = 0
        if weights.model is not None:
            self.rollout.update_weights(iter(weights.model.items()), WeightSyncStats())
            copied += len(weights.model)
        if weights.adapter is not None:
            self.rollout.update_adapter(iter(weights.adapter.items()), weights.adapter_config, WeightSyncStats())
            copied += len(weights.adapter)
        return copied

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_rollout_state(self, local_path: str) -> None:
        """Write this rank's RNG states (they draw the rollout's samples) into ``local_path``."""
        os.makedirs(local_path, exist_ok=True)
        with open(os.path.join(local_path, rng_file(self.rank)), "w", encoding="utf-8") as f:
            json.dump(get_rng_state(), f)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_rollout_state(self, local_path: str) -> None:
        """Restore what :meth:`save_rollout_state` wrote; ValueError naming the file when it is not RNG states."""
        path = os.path.join(local_path, rng_file(self.rank))
        with open(path, encoding="utf-8") as f:
            try:
                state = json.load(f)
                check_rng_state(state)
            except ValueError as exc:
                raise ValueError(f"{path}: not the rollout rank's RNG states ({exc})") from None
        set_rng_state(state)
