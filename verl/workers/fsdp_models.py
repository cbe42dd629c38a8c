"""The workers' FSDP models built from their config sections: the actor, the reference policy and the critic.

One definition for :mod:`verl.workers.fsdp_workers` and the memory trace (:mod:`verl.trainer.trace_preset`, which
builds them with ``load_weights=False`` under fake tensors): what each model keeps in which dtype, how it is
wrapped and which of its parameters the optimizer updates.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from verl.utils.fsdp_utils import build_fsdp_model, resolve_param_dtype
from verl.utils.lora import LoraSettings

DEFAULT_SEED = 42


def compute_dtype(section: Any, device_type: str) -> torch.dtype:
    """The dtype a model section (``actor_rollout_ref.actor`` or ``critic``) computes in on ``device_type``."""
    return resolve_param_dtype(section.get("fsdp_config", {}).get("param_dtype", "auto"), device_type)


def model_seed(section: Any) -> int:
    """The seed a section's model is initialised with (``seed``, default :data:`DEFAULT_SEED`)."""
    return int(section.get("seed", DEFAULT_SEED))


def trainable_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer updates: all of a fully trained model's, a LoRA model's adapter (and value
    head) only."""
    return [p for p in module.parameters() if p.requires_grad]


def _policy_args(cfg: Any, mesh: DeviceMesh, model_path: str, load_weights: bool) -> dict[str, Any]:
    """``build_fsdp_model`` arguments shared by the actor and the reference (``cfg``: ``actor_rollout_ref``)."""
    return {"model_path": model_path, "mesh": mesh, "fsdp_config": cfg.actor.get("fsdp_config", {}),
            "seed": model_seed(cfg.actor), "attn_implementation": cfg.model.get("attn_implementation", "auto"),
            "strategy": cfg.actor.get("strategy", "fsdp2"), "load_weights": load_weights}


def build_actor_module(cfg: Any, mesh: DeviceMesh, model_path: str, lora: LoraSettings | None,
                       gradient_checkpointing: bool, load_weights: bool = True) -> torch.nn.Module:
    """The policy (``cfg``: ``actor_rollout_ref``): fp32 master weights, or with ``lora`` a frozen base in the
    compute dtype beside a float32 adapter."""
    master = compute_dtype(cfg.actor, mesh.device_type) if lora else torch.float32
    return build_fsdp_model(AutoModelForCausalLM, gradient_checkpointing=gradient_checkpointing, lora=lora,
                            master_dtype=master, lora_where="actor_rollout_ref.model",
                            **_policy_args(cfg, mesh, model_path, load_weights))


def build_reference_module(cfg: Any, mesh: DeviceMesh, model_path: str, load_weights: bool = True
                           ) -> torch.nn.Module:
    """The frozen reference policy of a fully trained actor: kept in the compute dtype (bf16 on CUDA), no fp32
    master, no gradients."""
    module = build_fsdp_model(AutoModelForCausalLM, master_dtype=compute_dtype(cfg.actor, mesh.device_type),
                              **_policy_args(cfg, mesh, model_path, load_weights))
    module.requires_grad_(False)
    return module


def build_critic_module(cfg: Any, mesh: DeviceMesh, model_path: str, lora: LoraSettings | None,
                        load_weights: bool = True) -> torch.nn.Module:
    """The value model (``cfg``: ``critic``): a 1-label token classifier on the causal LM's backbone, fp32 master
    weights, or with ``lora`` a frozen backbone in the compute dtype, its adapter and value head trained."""
    return build_fsdp_model(
        AutoModelForTokenClassification, model_path=model_path, mesh=mesh, fsdp_config=cfg.get("fsdp_config", {}),
        seed=model_seed(cfg), attn_implementation=cfg.model.get("attn_implementation", "auto"),
        gradient_checkpointing=bool(cfg.model.get("enable_gradient_checkpointing", False)),
        config_overrides={"num_labels": 1, "classifier_dropout": 0.0}, strategy=cfg.get("strategy", "fsdp2"),
        master_dtype=compute_dtype(cfg, mesh.device_type) if lora else torch.float32, lora=lora,
        lora_task="token_cls", lora_where="critic.model", load_weights=load_weights,
    )  # fmt: skip
