"""The actor's weights handed to a rollout on devices of its own (split placement): gathered full on the actor's
rank 0, put once in Ray's object store, installed by every rank of the rollout's worker group into its own shards.

:func:`export_rollout_weights` runs on every actor rank (each bucket's gather is a collective, as for the vLLM
sync) and returns a :class:`RolloutWeights` on rank 0 only, in the rollout dtype: every weight (a fully trained
actor, or a LoRA actor's merged weights with ``model.lora.merge``), or a LoRA actor's adapter, with its frozen base
only while the rollout lacks it. :func:`install_full_weights` copies full tensors into a (FSDP2-, FSDP1- or un-)
sharded module of the same architecture: each rank takes its own rows of every parameter (FSDP2 shards dim 0 as
``torch.chunk`` does) and the master weights keep their dtype; :func:`install_rollout_weights` installs a whole
payload into an HF rollout's module.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor

from verl.utils.lora import (LoraSettings, adapter_config, adapter_tensor_name, base_parameter_name,
                             is_adapter_parameter, merged_weight_stream, peft_model_of)
from verl.workers.rollout.vllm_rollout.weight_sync import WeightSyncStats, fsdp_weight_stream, hf_parameter_name

__all__ = ["RolloutWeights", "adapter_key", "base_key", "export_full_weights", "export_rollout_weights",
           "install_full_weights", "install_rollout_weights"]


@dataclass
class RolloutWeights:
    """What a rollout of its own receives: ``model``, full tensors by HF name (every weight, the merged ones, or a
    LoRA actor's frozen base; None when the rollout holds the base already), and a LoRA actor's ``adapter``,
    its factors by PEFT's saved names, with ``adapter_config``, its PEFT config."""

    model: dict[str, torch.Tensor] | None = None
    adapter: dict[str, torch.Tensor] | None = None
    adapter_config: dict[str, Any] | None = None


def _collect(stream: Iterable[tuple[str, torch.Tensor]], keep: bool,
             rename: Callable[[str], str] = str) -> dict[str, torch.Tensor]:
    """Run ``stream`` to its end (its gathers are collectives); CPU copies of its tensors when ``keep``."""
    full: dict[str, torch.Tensor] = {}
    for name, tensor in stream:
        if keep:
            full[rename(name)] = tensor.detach().to("cpu", copy=True)
    return full


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def export_full_weights(module: torch.nn.Module, dtype: torch.dtype, bucket_bytes: int
                        ) -> tuple[dict[str, torch.Tensor] | None, WeightSyncStats]:
    """Every parameter of the FSDP-wrapped ``module`` as a full CPU tensor in ``dtype``, keyed by its HF name, on
    rank 0 (None on the other ranks, which take part in the gathers); and what was gathered."""
    stats, start, keep = WeightSyncStats(), time.perf_counter(), _rank0()
    full = _collect(fsdp_weight_stream(module, dtype, stats, bucket_bytes), keep)
    stats.seconds = time.perf_counter() - start
    return (full if keep else None), stats


def export_rollout_weights(module: torch.nn.Module, dtype: torch.dtype, bucket_bytes: int, lora: LoraSettings | None,
                           send_base: bool, base_model_path: str | None = None
                           ) -> tuple[RolloutWeights | None, WeightSyncStats]:
    """What the actor ``module`` (trained with ``lora``, or fully) sends a rollout of its own, on rank 0 (None on
    the other ranks); a LoRA actor's frozen base only with ``send_base``. And what was gathered."""
    if lora is None:
        full, stats = export_full_weights(module, dtype, bucket_bytes)
        return (None if full is None else RolloutWeights(model=full)), stats
    stats, start, keep = WeightSyncStats(), time.perf_counter(), _rank0()
    if lora.merge:
        merged = merged_weight_stream(fsdp_weight_stream(module, dtype, stats, bucket_bytes), lora.scaling)
        weights = RolloutWeights(model=_collect(merged, keep))
    else:
        base = None
        if send_base:
            stream = fsdp_weight_stream(module, dtype, stats, bucket_bytes, select=_is_base_parameter)
            base = _collect(stream, keep, base_parameter_name)
        factors = fsdp_weight_stream(module, dtype, stats, bucket_bytes, select=is_adapter_parameter)
        weights = RolloutWeights(model=base, adapter=_collect(factors, keep, adapter_tensor_name),
                                 adapter_config=adapter_config(module, base_model_path))
    stats.seconds = time.perf_counter() - start
    return (weights if keep else None), stats


def _is_base_parameter(name: str) -> bool:
    return not is_adapter_parameter(name)


def base_key(name: str) -> str | None:
    """The key of a LoRA rollout module's parameter ``name`` in the frozen base's tensors (None: an adapter's)."""
    hf = hf_parameter_name(name)
    return None if is_adapter_parameter(hf) else base_parameter_name(hf)


def adapter_key(name: str) -> str | None:
    """The key of a LoRA rollout module's parameter ``name`` in the adapter's tensors (None: the base's)."""
    hf = hf_parameter_name(name)
    return adapter_tensor_name(hf) if is_adapter_parameter(hf) else None


def install_rollout_weights(module: torch.nn.Module, weights: RolloutWeights) -> int:
    """Install ``weights`` into an HF rollout's ``module`` (a PEFT model when it carries the actor's adapter);
    returns how many tensors were copied. ValueError when the payload is not for this module."""
    if peft_model_of(module) is None:
        if weights.model is None or weights.adapter is not None:
            raise ValueError("this rollout's model carries no LoRA adapter: it takes full (or merged) weights only")
        return install_full_weights(module, weights.model)
    if weights.adapter is None:
        raise ValueError("this rollout's model carries the actor's LoRA adapter: the payload has none (merged or "
                         "full weights?)")
    copied = 0 if weights.model is None else install_full_weights(module, weights.model, base_key)
    return copied + install_full_weights(module, weights.adapter, adapter_key)


def install_full_weights(module: torch.nn.Module, weights: dict[str, torch.Tensor],
                         key: Callable[[str], str | None] = hf_parameter_name) -> int:
    """Copy ``weights`` (name -> full tensor) into ``module``'s parameters, the one whose ``key`` (default: its HF
    name; None leaves a parameter alone) is the tensor's name; returns how many were copied.

    ValueError naming the parameters when the names or shapes are not the module's (another model)."""
    params = {key(name): p for name, p in module.named_parameters() if key(name) is not None}
    if set(params) != set(weights):
        missing, extra = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
        raise ValueError(f"the exported weights are not this model's: missing {missing[:4]}, unknown {extra[:4]}")
    with torch.no_grad():
        if isinstance(module, FSDP):
            with FSDP.summon_full_params(module, recurse=True, writeback=True):
                for name, param in module.named_parameters():
                    if key(name) is not None:
                        _copy(key(name), param, weights[key(name)])
            return len(params)
        for name, param in params.items():
            full = weights[name]
            if isinstance(param, DTensor):
                local = param.to_local()
                rows = -(-param.shape[0] // param.device_mesh.size())
                start = param.device_mesh.get_local_rank() * rows
                _check_shape(name, param.shape, full.shape)
                local.copy_(full[start: start + local.shape[0]])
            else:
                _copy(name, param, full)
    return len(params)


def _copy(name: str, param: torch.Tensor, full: torch.Tensor) -> None:
    _check_shape(name, param.shape, full.shape)
    param.copy_(full)


def _check_shape(name: str, have: torch.Size, got: torch.Size) -> None:
    if tuple(have) != tuple(got):
        raise ValueError(f"the exported weight {name} has shape {tuple(got)}, this model's {tuple(have)}")
