"""The actor's weights as a stream of full (unsharded) tensors, gathered from FSDP one parameter at a time.

The stream feeds vLLM's in-place weight reload (:meth:`vLLMRollout.update_weights`): nothing is written to disk
and at most one gathered parameter (FSDP2) or the full model for the duration of the sync (FSDP1, whose
``summon_full_params`` gathers the flat parameters of every unit) is held besides the shards. Every rank of the
actor's process group must consume the stream in step (each gather is a collective), which holds because every
rank iterates the same module in the same order.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor

# Name parts that FSDP1 and activation checkpointing insert into parameter names (absent from the HF names).
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


@dataclass
class WeightSyncStats:
    """What one weight sync moved: parameters, bytes (in the rollout dtype) and wall time in seconds."""

    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def metrics(self, prefix: str = "rollout/weight_sync") -> dict[str, float]:
        """The stats as trainer metrics (``timing_s/weight_sync`` is the time, ``{prefix}_mb`` the size)."""
        return {"timing_s/weight_sync": self.seconds, f"{prefix}_mb": self.bytes / 2**20,
                f"{prefix}_tensors": float(self.tensors)}


def hf_parameter_name(name: str) -> str:
    """The Hugging Face name of a (possibly FSDP1- or checkpoint-wrapped) module's parameter."""
    for part in _WRAPPER_PREFIXES:
        name = name.replace(part, "")
    return name


def _full(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 (DTensor) parameter (an all-gather), or the parameter itself."""
    return param.full_tensor() if isinstance(param, DTensor) else param


def fsdp_weight_stream(module: torch.nn.Module, dtype: torch.dtype, stats: WeightSyncStats | None = None
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(HF parameter name, full tensor in dtype)`` for every parameter of the FSDP-wrapped ``module``.

    FSDP2 parameters are gathered one at a time; an FSDP1 model is gathered whole for the duration of the stream
    (``writeback=False``: the rollout never changes the actor). ``stats``, if given, counts what was yielded.
    """
    if isinstance(module, FSDP):
        with FSDP.summon_full_params(module, recurse=True, writeback=False), torch.no_grad():
            for name, param in module.named_parameters():
                yield _counted(hf_parameter_name(name), param.detach().to(dtype), stats)
        return
    with torch.no_grad():
        for name, param in module.named_parameters():
            yield _counted(hf_parameter_name(name), _full(param.detach()).to(dtype), stats)


def _counted(name: str, tensor: torch.Tensor, stats: WeightSyncStats | None) -> tuple[str, torch.Tensor]:
    if stats is not None:
        stats.tensors += 1
        stats.bytes += tensor.numel() * tensor.element_size()
    return name, tensor


class Stopwatch:
    """Wall time of a ``with`` block, added to ``stats.seconds``."""

    def __init__(self, stats: WeightSyncStats):
        self.stats = stats
        self._start = 0.0

    def __enter__(self) -> "Stopwatch":
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stats.seconds += time.perf_counter() - self._start
