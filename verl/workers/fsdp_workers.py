"""FSDP workers run by the Ray worker group: the actor/rollout/reference worker and the critic worker.

Each worker process joins the group's torch.distributed process group (gloo on CPU, nccl on CUDA) in
``init_model``, loads the HF model (FSDP2: rank 0 reads it, the others receive their shards), shards it per
decoder layer and then at the root, with FSDP2 (``strategy: fsdp2``, default) or FSDP1 (``strategy: fsdp``), and
exposes the veRL worker methods listed in docs/architecture.md. Every compute method ends by returning the
device's cached memory (``empty_cache``; actor and critic share a GPU as two processes).
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, open_dict

from verl.protocol import DataProto
from verl.single_controller.base import Dispatch, Worker, register
from verl.utils.device import empty_cache, get_device_name
from verl.utils.fsdp_offload import FSDPOffloader
from verl.utils.fsdp_utils import check_strategy, create_device_mesh
from verl.utils.lora import LoraSettings, adapters_disabled
from verl.utils.shm_model import model_dir
from verl.utils.optim import build_lr_scheduler, build_optimizer
from verl.workers.actor.dp_actor import DataParallelPPOActor
from verl.workers.critic.dp_critic import DataParallelPPOCritic
from verl.workers.fsdp_models import (build_actor_module, build_critic_module, build_reference_module, compute_dtype,
                                      model_seed, trainable_parameters)
from verl.workers.fsdp_checkpoint import FSDPCheckpointManager
from verl.workers.rollout.hf_rollout import HFRollout
from verl.workers.rollout.logprob_mismatch import logprob_mismatch_metrics
from verl.workers.rollout.standalone_weights import export_rollout_weights
from verl.workers.worker_inputs import load_worker_tokenizer, resolved_copy, rows_per_rank, with_meta_defaults

logger = logging.getLogger(__name__)

ROLES = ("actor", "rollout", "ref", "actor_ref", "actor_rollout", "actor_rollout_ref")
ROLLOUT_NAMES = ("hf", "vllm")


class ActorRolloutRefWorker(Worker):
    """Policy worker: PPO actor, its rollout engine and/or the frozen reference policy.

    The rollout (``rollout.name``) is HF generate on the actor's sharded weights (``hf``) or a vLLM engine in
    this process (``vllm``, the hybrid engine) that receives the actor's weights in memory at start, after every
    ``update_actor`` and after ``load_checkpoint``, and frees its GPU memory during training phases.

    With ``model.lora_rank`` > 0 the actor is a PEFT LoRA model (:mod:`verl.utils.lora`): its frozen base is kept in
    the compute dtype, the optimizer holds the adapter only, the reference policy is the actor with its adapter
    disabled (no second copy of the base), and a vLLM engine gets the base once and the adapter after every
    update (or the merged weights, ``model.lora.merge``).

    ``config`` is ``cfg.actor_rollout_ref``; ``role`` is one of ``actor``, ``rollout``, ``ref``, ``actor_ref``
    (the actor of a rollout on devices of its own: :mod:`verl.workers.rollout_worker`), ``actor_rollout``,
    ``actor_rollout_ref``.
    """

    hybrid_rollout = True  # a vLLM rollout here shares the actor's process (the rollout role alone needs the actor)

    def __init__(self, config: DictConfig, role: str):
        super().__init__()
        if role not in ROLES:
            raise ValueError(f"ActorRolloutRefWorker role={role!r}; expected one of {list(ROLES)}")
        self.config = resolved_copy(config, "ActorRolloutRefWorker config (actor_rollout_ref)")
        self.role = role
        self._is_actor = role in ("actor", "actor_ref", "actor_rollout", "actor_rollout_ref")
        self._is_rollout = role in ("rollout", "actor_rollout", "actor_rollout_ref")
        self._is_ref = role in ("ref", "actor_ref", "actor_rollout_ref")
        check_strategy(self.config.actor.get("strategy", "fsdp2"), "actor_rollout_ref.actor.strategy")
        self.rollout_name = self.config.rollout.get("name", "hf")
        if self._is_rollout and self.rollout_name not in ROLLOUT_NAMES:
            raise ValueError(f"actor_rollout_ref.rollout.name={self.rollout_name!r}; expected one of {list(ROLLOUT_NAMES)}")
        if self._is_rollout and self.rollout_name == "vllm" and not self._is_actor and self.hybrid_rollout:
            raise ValueError("actor_rollout_ref.rollout.name=vllm is a hybrid engine: it needs the actor in the same "
                             f"worker (role actor_rollout or actor_rollout_ref, got {role!r})")
        self.tokenizer: Any = None
        self.actor: DataParallelPPOActor | None = None
        self.rollout: Any = None  # HFRollout or vLLMRollout
        self._module: torch.nn.Module | None = None
        self.ref_policy: DataParallelPPOActor | None = None
        self.lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.checkpoint_manager: FSDPCheckpointManager | None = None
        self.actor_offload: FSDPOffloader | None = None
        self.ref_offload: FSDPOffloader | None = None
        self.lora = LoraSettings.from_model_config(self.config.model, "actor_rollout_ref.model") \
            if self._is_actor else None

    def _require(self, enabled: bool, method: str, needed: str) -> None:
        """Raise naming ``method`` unless this worker's role includes ``needed`` and init_model has run."""
        if not enabled:
            raise RuntimeError(f"{method} needs a worker with the {needed} role; this one has role {self.role!r}")
        if self.tokenizer is None:
            raise RuntimeError(f"{method} called before init_model")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Join the process group, load and shard the model(s), build optimizer, scheduler and rollout."""
        self.init_distributed(timeout_s=float(self.config.get("nccl_timeout", 600)))
        mesh = create_device_mesh(get_device_name())
        cfg = self.config
        model_path = model_dir(cfg.model.path, bool(cfg.model.get("use_shm", False)))
        self.tokenizer = load_worker_tokenizer(cfg.model, model_path)
        actor_cfg = copy.deepcopy(cfg.actor)
        with open_dict(actor_cfg):
            if self._is_actor:  # a rollout of its own (split placement) trains nothing
                actor_cfg.ppo_mini_batch_size = rows_per_rank(
                    cfg.actor.ppo_mini_batch_size, cfg.rollout.get("n", 1), self.world_size,
                    "actor_rollout_ref.actor.ppo_mini_batch_size",
                )  # fmt: skip
            actor_cfg.use_remove_padding = bool(cfg.model.get("use_remove_padding", False))
        seed = model_seed(cfg.actor)
        dtype = compute_dtype(cfg.actor, mesh.device_type)
        if self._is_actor or self._is_rollout:
            gradient_checkpointing = self._is_actor and bool(cfg.model.get("enable_gradient_checkpointing", False))
            module = build_actor_module(cfg, mesh, model_path, self.lora, gradient_checkpointing)
            optimizer = None
            if self._is_actor:
                optimizer = build_optimizer(trainable_parameters(module), cfg.actor.optim)
                self.lr_scheduler = build_lr_scheduler(optimizer, cfg.actor.optim)
                self.checkpoint_manager = FSDPCheckpointManager(module, optimizer, self.lr_scheduler, self.tokenizer,
                                                                export_dtype=dtype,
                                                                timeout_s=cfg.get("checkpoint_timeout", 3600),
                                                                base_model_path=cfg.model.path)
            self.actor = DataParallelPPOActor(actor_cfg, module, optimizer)
            fsdp_cfg = cfg.actor.get("fsdp_config", {})
            self.actor_offload = FSDPOffloader(
                module, optimizer, fsdp_cfg.get("param_offload", False), fsdp_cfg.get("optimizer_offload", False),
                "actor_rollout_ref.actor.fsdp_config",
            )  # fmt: skip
            self._module = module
            if self._is_rollout:
                self.rollout = self._build_rollout(module, model_path)
            self.actor_offload.offload()
        if self._is_ref and self.lora is None:  # frozen: kept in the compute dtype (bf16 on CUDA), no fp32 master
            ref_module = build_reference_module(cfg, mesh, model_path)
            self.ref_policy = DataParallelPPOActor(actor_cfg, ref_module)
            ref_param_offload = cfg.ref.get("fsdp_config", {}).get("param_offload", False)
            self.ref_offload = FSDPOffloader(ref_module, None, ref_param_offload, False,
                                             "actor_rollout_ref.ref.fsdp_config")
            self.ref_offload.offload()
        torch.manual_seed(seed + self.rank)
        logger.info("rank %d: ActorRolloutRefWorker(%s) ready", self.rank, self.role)

    def _build_rollout(self, module: torch.nn.Module, model_path: str) -> Any:
        """The ``rollout.name`` engine: HF generate on ``module``, or a colocated vLLM engine given its weights."""
        cfg = self.config
        if self.rollout_name == "hf":
            return HFRollout(module, cfg.rollout)
        rollout = self._build_vllm_engine(model_path)
        self._sync_rollout_weights(rollout)
        return rollout

    def _build_vllm_engine(self, model_path: str) -> Any:
        """A vLLM engine for ``model_path`` in this process, in ``rollout.dtype`` (auto: the actor's compute dtype,
        so rollout and training see the same numbers), holding dummy weights until the first sync."""
        from verl.workers.rollout.vllm_rollout import vLLMRollout

        cfg = self.config
        dtype = cfg.rollout.get("dtype", "auto")
        if dtype == "auto":
            dtype = str(compute_dtype(cfg.actor, get_device_name())).removeprefix("torch.")
        return vLLMRollout(model_path, cfg.rollout, dtype, get_device_name(),
                           tokenizer_path=cfg.model.get("tokenizer_path", None), lora=self.lora)

    def _sync_rollout_weights(self, rollout: Any = None) -> dict[str, float]:
        """Stream the actor's current weights into the vLLM engine (in memory); returns the sync metrics.

        A LoRA actor sends its base only while the engine lacks it (at start) and then its adapter; with
        ``model.lora.merge`` the merged weights (:func:`verl.workers.rollout.vllm_rollout.sync_actor_weights`)."""
        from verl.workers.rollout.vllm_rollout import WeightSyncStats, sync_actor_weights

        rollout = rollout or self.rollout
        stats = WeightSyncStats()
        with self.actor_offload.on_device():  # offloaded actor parameters come back to the GPU for the gather
            sync_actor_weights(self._module, rollout, stats, self.lora, self.config.model.path)
        logger.info("rank %d: synced %d tensors (%.1f MiB) into vLLM in %.3f s", self.rank, stats.tensors,
                    stats.bytes / 2**20, stats.seconds)
        return stats.metrics()

    def _release_rollout(self) -> None:
        """Free the rollout engine's GPU memory before a training phase (vLLM's sleep; nothing for hf or on CPU)."""
        if self.rollout is not None:
            self.rollout.sleep()

    def _refresh_rollout_weights(self) -> None:
        """Give the vLLM engine the actor's weights again if its sleep freed them and no update has synced them
        since (e.g. a step without an actor update: ``trainer.critic_warmup``). A collective over all ranks."""
        if self.rollout_name == "vllm" and self.rollout.weights_discarded:
            self._sync_rollout_weights()

    def _policy_version(self) -> int:
        """The version of this worker's weights: the actor's updates so far (its LR schedule's steps, checkpointed
        with it); 0 without an actor."""
        return self.lr_scheduler.last_epoch if self.lr_scheduler is not None else 0

    def _generation_input(self, prompts: DataProto) -> DataProto:
        """``prompts`` with the tokenizer's EOS/pad as defaults; the engine told its policy version."""
        self.rollout.policy_version = self._policy_version()
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        return with_meta_defaults(prompts, {"eos_token_id": self.tokenizer.eos_token_id, "pad_token_id": pad})

    def _log_prob_defaults(self, section: DictConfig) -> dict[str, Any]:
        """meta_info defaults of a log-prob pass configured by ``section`` (rollout or ref): rows (or, with
        ``log_prob_use_dynamic_bsz``, tokens) per forward and the rollout temperature."""
        micro = section.get("log_prob_micro_batch_size_per_gpu") or self.config.actor.ppo_micro_batch_size_per_gpu
        return {"micro_batch_size": micro, "temperature": self.config.rollout.get("temperature", 1.0),
                "use_dynamic_bsz": bool(section.get("log_prob_use_dynamic_bsz", False)),
                "max_token_len": section.get("log_prob_max_token_len_per_gpu", None)}

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Generate one response per prompt row (see :class:`HFRollout`); tokenizer EOS/pad by default."""
        self._require(self._is_rollout, "generate_sequences", "rollout")
        prompts = self._generation_input(prompts)
        if self.rollout_name == "vllm":  # the engine holds its own copy of the weights
            self._refresh_rollout_weights()
            return self.rollout.generate_sequences(prompts)
        with self.actor_offload.on_device():
            output = self.rollout.generate_sequences(prompts)
        empty_cache()
        return output

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rollout_replica_index(self) -> int | None:
        """This rank's rollout replica (vLLM: its tensor-parallel group, which can generate a batch of its own);
        None when generation is one collective over all ranks (the HF rollout on FSDP shards).

        Called on every rank before replicas generate on their own, it also gives a vLLM engine whose sleep freed
        its weights the actor's weights again (a collective that :meth:`generate_replica_sequences`, run on one
        replica's ranks only, cannot do)."""
        self._require(self._is_rollout, "rollout_replica_index", "rollout")
        if self.rollout_name != "vllm":
            return None
        self._refresh_rollout_weights()
        return dist.get_rank() // self.rollout.tp_group.world_size

    def generate_replica_sequences(self, prompts: DataProto) -> DataProto:
        """Generate every row of ``prompts`` on this rank's replica; called (unregistered, through
        ``RayWorkerGroup.execute_ranks_sync``) on exactly the ranks of one replica, each with the whole batch."""
        self._require(self._is_rollout and self.rollout_name == "vllm", "generate_replica_sequences", "vLLM rollout")
        return self.rollout.generate_replica_sequences(self._generation_input(prompts))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_rollout_weights(self, send_base: bool = True) -> tuple[Any, int, dict[str, float]] | None:
        """For a rollout on devices of its own: (an object-store reference to the weights it needs, a
        :class:`~verl.workers.rollout.standalone_weights.RolloutWeights` in the compute dtype, their policy version,
        the gather's metrics) on rank 0; None on the others, which take part. A LoRA actor sends its adapter, and
        its frozen base only with ``send_base`` (the rollout lacks it); with ``model.lora.merge`` merged weights."""
        self._require(self._is_actor or self._is_rollout, "export_rollout_weights", "actor or rollout")
        import ray

        bucket = int(self.config.rollout.get("update_weights_bucket_megabytes", 512) * 2**20)
        dtype = compute_dtype(self.config.actor, get_device_name())
        with self.actor_offload.on_device():
            weights, stats = export_rollout_weights(self._module, dtype, bucket, self.lora, send_base,
                                                    self.config.model.path)
        return None if weights is None else (ray.put(weights), self._policy_version(), stats.metrics())

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """Current-policy log-probs and entropies of ``responses``: ``old_log_probs``, ``entropys``."""
        self._require(self._is_actor, "compute_log_prob", "actor")
        self._release_rollout()
        start = time.perf_counter()
        data = with_meta_defaults(data, self._log_prob_defaults(self.config.rollout))
        with self.actor_offload.on_device():
            log_probs, entropys = self.actor.compute_log_prob(data, calculate_entropy=True)
        metrics = {"timing_s/worker_compute_log_prob": time.perf_counter() - start}
        empty_cache()
        return DataProto.from_dict(
            tensors={"old_log_probs": log_probs, "entropys": entropys}, meta_info={"metrics": metrics}
        )

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """Reference-policy log-probs of ``responses``: ``ref_log_prob`` (a LoRA actor's with its adapter
        disabled)."""
        self._require(self._is_ref, "compute_ref_log_prob", "ref")
        self._release_rollout()
        data = with_meta_defaults(data, self._log_prob_defaults(self.config.ref))
        if self.lora is not None:
            with self.actor_offload.on_device(), adapters_disabled(self._module):
                log_probs, _ = self.actor.compute_log_prob(data, calculate_entropy=False)
        else:
            with self.ref_offload.on_device():
                log_probs, _ = self.ref_policy.compute_log_prob(data, calculate_entropy=False)
        empty_cache()
        return DataProto.from_dict(tensors={"ref_log_prob": log_probs})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_actor(self, data: DataProto) -> DataProto:
        """One PPO training step on this rank's rows; returns ``meta_info['metrics']`` (lists) incl. ``actor/lr``.

        The learning-rate schedule advances once per call.
        """
        self._require(self._is_actor, "update_actor", "actor")
        self._release_rollout()
        start = time.perf_counter()
        data = with_meta_defaults(data, {"temperature": self.config.rollout.get("temperature", 1.0)})
        keys = data.batch.keys()
        mismatch = {}
        if "rollout_log_probs" in keys and "old_log_probs" in keys:  # before the update: old = the rollout's policy
            mismatch = logprob_mismatch_metrics(data.batch["rollout_log_probs"], data.batch["old_log_probs"],
                                                data.batch["response_mask"])
        with self.actor_offload.on_device(with_optimizer=True):
            metrics = self.actor.update_policy(data)
        metrics["actor/lr"] = [self.lr_scheduler.get_last_lr()[0]]
        self.lr_scheduler.step()
        metrics["timing_s/worker_update_actor"] = [time.perf_counter() - start]
        if self.rollout_name == "vllm" and self._is_rollout:
            mismatch.update(self._sync_rollout_weights())
        metrics.update({key: [value] for key, value in mismatch.items()})
        empty_cache()
        return DataProto(meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str, global_step: int = 0, max_ckpt_to_keep: int | None = None,
                        save_hf_model: bool = True) -> None:
        """Write the actor's resume state and, with ``save_hf_model``, its HF export into ``local_path``
        (:mod:`verl.workers.fsdp_checkpoint`); ``global_step`` is logged, ``max_ckpt_to_keep`` accepted for veRL
        (the trainer keeps the step directories: ``verl.utils.checkpoint``)."""
        self._require(self._is_actor, "save_checkpoint", "actor")
        logger.info("rank %d: saving actor checkpoint of step %d to %s", self.rank, global_step, local_path)
        with self.actor_offload.on_device(with_optimizer=True):
            self.checkpoint_manager.save_checkpoint(local_path, hf_model=save_hf_model)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str) -> None:
        """Restore the actor's weights, optimizer, LR schedule and RNG states from ``local_path``."""
        self._require(self._is_actor, "load_checkpoint", "actor")
        self._release_rollout()
        with self.actor_offload.on_device(with_optimizer=True):
            self.checkpoint_manager.load_checkpoint(local_path)
        if self.rollout_name == "vllm" and self._is_rollout:
            self._sync_rollout_weights()


class CriticWorker(Worker):
    """Value-function worker: an FSDP-sharded ``AutoModelForTokenClassification(num_labels=1)``. ``config`` is ``cfg.critic``; the model is loaded from ``critic.model.path`` (a causal-LM directory: its
    backbone is reused and a scalar value head is initialised with the same seed on every rank). With
    ``critic.model.lora_rank`` > 0 the backbone is frozen in the compute dtype and trained through a LoRA adapter,
    the value head whole; the optimizer holds those only.
    """

    def __init__(self, config: DictConfig):
        super().__init__()
        self.config = resolved_copy(config, "CriticWorker config (critic)")
        check_strategy(self.config.get("strategy", "fsdp2"), "critic.strategy")
        self.tokenizer: Any = None
        self.critic: DataParallelPPOCritic | None = None
        self.lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.checkpoint_manager: FSDPCheckpointManager | None = None
        self.critic_offload: FSDPOffloader | None = None
        self.lora = LoraSettings.from_model_config(self.config.model, "critic.model")

    def _require_init(self, method: str) -> None:
        """Raise naming ``method`` if init_model has not run."""
        if self.critic is None:
            raise RuntimeError(f"CriticWorker.{method} called before init_model")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Join the process group, load and shard the value model, build optimizer and scheduler."""
        self.init_distributed(timeout_s=float(self.config.get("nccl_timeout", 600)))
        cfg = self.config
        mesh = create_device_mesh(get_device_name())
        model_path = model_dir(cfg.model.path, bool(cfg.model.get("use_shm", False)))
        self.tokenizer = load_worker_tokenizer(cfg.model, model_path)
        critic_cfg = copy.deepcopy(cfg)
        with open_dict(critic_cfg):
            critic_cfg.ppo_mini_batch_size = rows_per_rank(cfg.ppo_mini_batch_size, cfg.get("rollout_n", 1),
                                                            self.world_size, "critic.ppo_mini_batch_size")
            critic_cfg.use_remove_padding = bool(cfg.model.get("use_remove_padding", False))
        seed = model_seed(cfg)
        module = build_critic_module(cfg, mesh, model_path, self.lora)
        optimizer = build_optimizer(trainable_parameters(module), cfg.optim)
        self.lr_scheduler = build_lr_scheduler(optimizer, cfg.optim)
        self.checkpoint_manager = FSDPCheckpointManager(module, optimizer, self.lr_scheduler, self.tokenizer,
                                                        export_dtype=compute_dtype(cfg, mesh.device_type),
                                                        timeout_s=cfg.get("checkpoint_timeout", 3600),
                                                        base_model_path=cfg.model.path)
        self.critic = DataParallelPPOCritic(critic_cfg, module, optimizer)
        offload_cfg = cfg.model.get("fsdp_config", {})
        self.critic_offload = FSDPOffloader(
            module, optimizer, offload_cfg.get("param_offload", False), offload_cfg.get("optimizer_offload", False),
            "critic.model.fsdp_config",
        )  # fmt: skip
        self.critic_offload.offload()
        torch.manual_seed(seed + self.rank)
        logger.info("rank %d: CriticWorker ready", self.rank)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        """Values (bs, R) of the states preceding each response token: ``values``."""
        self._require_init("compute_values")
        micro = self.config.get("forward_micro_batch_size_per_gpu", None) or self.config.ppo_micro_batch_size_per_gpu
        defaults = {"micro_batch_size": micro, "use_dynamic_bsz": bool(self.config.get("use_dynamic_bsz", False)),
                    "max_token_len": self.config.get("forward_max_token_len_per_gpu", None)}
        with self.critic_offload.on_device():
            values = self.critic.compute_values(with_meta_defaults(data, defaults))
        empty_cache()
        return DataProto.from_dict(tensors={"values": values})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_critic(self, data: DataProto) -> DataProto:
        """One value-function training step; returns ``meta_info['metrics']`` (lists) incl. ``critic/lr``."""
        self._require_init("update_critic")
        with self.critic_offload.on_device(with_optimizer=True):
            metrics = self.critic.update_critic(data)
        metrics["critic/lr"] = [self.lr_scheduler.get_last_lr()[0]]
        self.lr_scheduler.step()
        empty_cache()
        return DataProto(meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str, global_step: int = 0, max_ckpt_to_keep: int | None = None,
                        save_hf_model: bool = True) -> None:
        """Write the critic's resume state and, with ``save_hf_model``, its HF export into ``local_path``
        (``max_ckpt_to_keep``: see actor)."""
        self._require_init("save_checkpoint")
        logger.info("rank %d: saving critic checkpoint of step %d to %s", self.rank, global_step, local_path)
        with self.critic_offload.on_device(with_optimizer=True):
            self.checkpoint_manager.save_checkpoint(local_path, hf_model=save_hf_model)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str) -> None:
        """Restore the critic's weights, optimizer, LR schedule and RNG states from ``local_path``."""
        self._require_init("load_checkpoint")
        with self.critic_offload.on_device(with_optimizer=True):
            self.checkpoint_manager.load_checkpoint(local_path)
