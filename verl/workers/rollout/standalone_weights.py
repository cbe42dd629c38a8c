"""The actor's weights handed to a rollout on devices of its own (split placement): gathered full on the actor's
rank 0, put once in Ray's object store, installed by every rank of the rollout's worker group into its own shards.

:func:`export_full_weights` runs on every actor rank (each bucket's gather is a collective, as for the vLLM sync)
and returns the HF-named full tensors on rank 0 only, in the rollout dtype. :func:`install_full_weights` copies
them into a (FSDP2-, FSDP1- or un-)sharded module of the same architecture: each rank takes its own rows of every
parameter (FSDP2 shards dim 0 as ``torch.chunk`` does) and the master weights keep their dtype.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor

from verl.workers.rollout.vllm_rollout.weight_sync import WeightSyncStats, fsdp_weight_stream, hf_parameter_name

__all__ = ["export_full_weights", "install_full_weights"]


def export_full_weights(module: torch.nn.Module, dtype: torch.dtype, bucket_bytes: int
                        ) -> tuple[dict[str, torch.Tensor] | None, WeightSyncStats]:
    """Every parameter of the FSDP-wrapped ``module`` as a full CPU tensor in ``dtype``, keyed by its HF name, on
    rank 0 (None on the other ranks, which take part in the gathers); and what was gathered."""
    stats, start = WeightSyncStats(), time.perf_counter()
    keep = not dist.is_initialized() or dist.get_rank() == 0
    full: dict[str, torch.Tensor] = {}
    for name, tensor in fsdp_weight_stream(module, dtype, stats, bucket_bytes):
        if keep:
            full[name] = tensor.detach().to("cpu", copy=True)
    stats.seconds = time.perf_counter() - start
    return (full if keep else None), stats


def install_full_weights(module: torch.nn.Module, weights: dict[str, torch.Tensor]) -> int:
    """Copy ``weights`` (HF name -> full tensor) into ``module``'s parameters; returns how many were copied.

    ValueError naming the parameters when the names or shapes are not the module's (another model)."""
    params = {hf_parameter_name(name): p for name, p in module.named_parameters()}
    if set(params) != set(weights):
        missing, extra = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
        raise ValueError(f"the exported weights are not this model's: missing {missing[:4]}, unknown {extra[:4]}")
    with torch.no_grad():
        if isinstance(module, FSDP):
            with FSDP.summon_full_params(module, recurse=True, writeback=True):
                for name, param in module.named_parameters():
                    _copy(hf_parameter_name(name), param, weights[hf_parameter_name(name)])
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
