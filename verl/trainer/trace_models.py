"""The traced rank's world and models: a fake process group of N ranks, fake tensors, and the workers' FSDP models
built at full size from a ``config.json`` alone (:mod:`verl.workers.fsdp_models`, ``load_weights=False``).

One rank is traced; the other ranks exist only as the process group's size (the ``fake`` backend's collectives do
nothing), so each FSDP2 shard has the size it has on that rank of a real run. Tensors are fake
(``FakeTensorMode``): shapes, dtypes and storages without memory. The device decisions the workers take on CUDA are
taken here as on CUDA: ``param_dtype: auto`` is bf16 and AdamW steps with its foreach kernels (torch's default
there). The tensors themselves are CPU tensors (FSDP2 needs a CUDA runtime for a CUDA mesh), so the packed
attention runs its CPU branch (SDPA per sequence).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf, open_dict
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh

from verl.utils.fsdp_utils import create_device_mesh
from verl.utils.lora import LoraSettings
from verl.utils.optim import build_optimizer
from verl.workers.fsdp_models import (build_actor_module, build_critic_module, build_reference_module,
                                      trainable_parameters)

TRACE_DEVICE = "cpu"
CUDA_PARAM_DTYPE = "bf16"  # what fsdp_config.param_dtype=auto resolves to on CUDA (fsdp_utils.resolve_param_dtype)


def _fake_store() -> dist.Store:
    """The store of a fake process group; importing torch's fake-backend module registers the ``fake`` backend on
    the releases that do not have it built in (torch 2.13 imports the same module itself for ``store=None``)."""
    try:
        module = importlib.import_module("torch.testing._internal.distributed.fake_pg")
    except ImportError as exc:
        raise RuntimeError(f"this torch ({torch.__version__}) has no 'fake' distributed backend to trace with "
                           f"({exc})") from None
    return module.FakeStore()


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[DeviceMesh]:
    """torch.distributed over ``world_size`` ranks with the ``fake`` backend, this process rank 1 (rank 0 alone
    when the world is 1), and fake tensors inside the block; yields the workers' device mesh. Both are torn down
    after the block."""
    if world_size < 1:
        raise ValueError(f"the traced world needs at least one rank, got {world_size}")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; the trace needs its own "
                           "(run python -m verl.trainer.trace_preset in a fresh process)")
    dist.init_process_group("fake", store=_fake_store(), rank=min(1, world_size - 1), world_size=world_size)
    try:
        mesh = create_device_mesh(TRACE_DEVICE)  # with real tensors: the mesh reads its ranks
        with FakeTensorMode():
            yield mesh
    finally:
        dist.destroy_process_group()


def worker_section(section: DictConfig) -> DictConfig:
    """A resolved copy of a worker's config section (``actor_rollout_ref`` or ``critic``) whose
    ``param_dtype: auto`` is what CUDA resolves it to."""
    copy = OmegaConf.create(OmegaConf.to_container(section, resolve=True))
    fsdp_configs = [copy.actor.fsdp_config, copy.ref.fsdp_config] if "actor" in copy else [copy.fsdp_config]
    for fsdp_config in fsdp_configs:
        with open_dict(fsdp_config):
            if fsdp_config.get("param_dtype", "auto") in (None, "auto"):
                fsdp_config.param_dtype = CUDA_PARAM_DTYPE
    return copy


@dataclass
class TracedModels:
    """The models of the traced rank (all of them share its GPU) and the optimizers the workers build."""

    actor: torch.nn.Module
    actor_optimizer: torch.optim.Optimizer
    actor_lora: LoraSettings | None
    reference: torch.nn.Module | None
    critic: torch.nn.Module | None
    critic_optimizer: torch.optim.Optimizer | None


def _optimizer(module: torch.nn.Module, optim_cfg: Any) -> torch.optim.Optimizer:
    """The worker's AdamW with its state allocated (a step on zero gradients: the state every step after the first
    holds) and stepping with foreach kernels, as on CUDA."""
    optimizer = build_optimizer(trainable_parameters(module), optim_cfg)
    for group in optimizer.param_groups:
        group["foreach"] = True
    for param in trainable_parameters(module):
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def build_models(mesh: DeviceMesh, actor_cfg: DictConfig, critic_cfg: DictConfig | None, model_path: str,
                 need_reference: bool, critic_path: str | None = None) -> TracedModels:
    """The workers' models on the traced rank (inside :func:`fake_world`, on its ``mesh``): the actor and its
    optimizer, the reference when ``need_reference`` and the actor trains every weight (a LoRA actor is its own
    reference), and the critic with its optimizer when ``critic_cfg`` is given (from ``critic_path``, default
    ``model_path``). ``actor_cfg`` / ``critic_cfg`` come from :func:`worker_section`."""
    lora = LoraSettings.from_model_config(actor_cfg.model, "actor_rollout_ref.model")
    checkpointing = bool(actor_cfg.model.get("enable_gradient_checkpointing", False))
    actor = build_actor_module(actor_cfg, mesh, model_path, lora, checkpointing, load_weights=False)
    reference = None
    if lora is None and need_reference:
        reference = build_reference_module(actor_cfg, mesh, model_path, load_weights=False)
    critic = critic_optimizer = None
    if critic_cfg is not None:
        critic_lora = LoraSettings.from_model_config(critic_cfg.model, "critic.model")
        critic = build_critic_module(critic_cfg, mesh, critic_path or model_path, critic_lora, load_weights=False)
        critic_optimizer = _optimizer(critic, critic_cfg.optim)
    return TracedModels(actor=actor, actor_optimizer=_optimizer(actor, actor_cfg.actor.optim), actor_lora=lora,
                        reference=reference, critic=critic, critic_optimizer=critic_optimizer)
