"""The actor's weights as a stream of full (unsharded) tensors in the rollout dtype, gathered from FSDP in buckets.

The stream feeds vLLM's in-place weight reload (:meth:`vLLMRollout.update_weights`): nothing is written to disk.
With FSDP2 each rank casts its shards to the rollout dtype first (bf16 on CUDA: half the bytes of the fp32
master weights) and the shards of consecutive parameters are gathered together, one ``all_gather_into_tensor`` per
bucket of about ``bucket_bytes`` (``rollout.update_weights_bucket_megabytes``) instead of one collective per
parameter; a bucket's gathered buffer and its full tensors (about twice the bucket) are held besides the shards
while vLLM loads them. FSDP1's ``summon_full_params`` gathers the flat parameters of every unit for the duration
of the sync. Every rank of the actor's process group must consume the stream in step (each gather is a
collective), which holds because every rank iterates the same module in the same order.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor, Shard

# Name parts that FSDP1 and activation checkpointing insert into parameter names (absent from the HF names).
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
DEFAULT_BUCKET_BYTES = 512 * 2**20  # rollout.update_weights_bucket_megabytes' default
# One tensor gathered from every rank into one buffer: ``all_gather_single`` from torch 2.13, which deprecates the
# older name with the same arguments.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class WeightSyncStats:
    """What one weight sync moved: parameters, bytes (in the rollout dtype), collectives and wall time (s)."""

    tensors: int = 0
    bytes: int = 0
    gathers: int = 0
    seconds: float = 0.0

    def metrics(self, prefix: str = "rollout/weight_sync") -> dict[str, float]:
        """The stats as trainer metrics (``timing_s/weight_sync`` is the time, ``{prefix}_mb`` the size)."""
        return {"timing_s/weight_sync": self.seconds, f"{prefix}_mb": self.bytes / 2**20,
                f"{prefix}_tensors": float(self.tensors), f"{prefix}_gathers": float(self.gathers)}


def hf_parameter_name(name: str) -> str:
    """The Hugging Face name of a (possibly FSDP1- or checkpoint-wrapped) module's parameter."""
    for part in _WRAPPER_PREFIXES:
        name = name.replace(part, "")
    return name


def fsdp_weight_stream(module: torch.nn.Module, dtype: torch.dtype, stats: WeightSyncStats | None = None,
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES, select: Callable[[str], bool] | None = None,
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(HF parameter name, full tensor in dtype)`` for every parameter of the FSDP-wrapped ``module`` (those
    whose name ``select`` accepts, when given; every rank must select the same).

    FSDP2 parameters are cast on their shards and gathered in buckets of about ``bucket_bytes`` (full size in
    ``dtype``; a larger parameter is a bucket of its own); an FSDP1 model is gathered whole for the duration of
    the stream (``writeback=False``: the rollout never changes the actor). ``stats``, if given, counts what was
    yielded and the collectives it took.
    """
    if bucket_bytes < 1:
        raise ValueError(f"rollout.update_weights_bucket_megabytes must be > 0, got {bucket_bytes / 2**20:g}")
    stats = stats if stats is not None else WeightSyncStats()
    if isinstance(module, FSDP):
        with FSDP.summon_full_params(module, recurse=True, writeback=False), torch.no_grad():
            for name, param in module.named_parameters():
                if select is None or select(hf_parameter_name(name)):
                    yield _counted(hf_parameter_name(name), param.detach().to(dtype), stats)
        return
    params = [(name, p) for name, p in module.named_parameters() if select is None or select(hf_parameter_name(name))]
    with torch.no_grad():
        for bucket in _buckets(params, dtype, bucket_bytes):
            for name, tensor in _gather_bucket(bucket, dtype, stats):
                yield _counted(hf_parameter_name(name), tensor, stats)


def _row_sharded(param: torch.Tensor) -> bool:
    """Whether ``param`` is an FSDP2 parameter: a DTensor sharded along dim 0 over a 1-D mesh."""
    return (isinstance(param, DTensor) and param.device_mesh.ndim == 1 and param.dim() > 0
            and tuple(param.placements) == (Shard(0),))


def _buckets(params: list[tuple[str, torch.Tensor]], dtype: torch.dtype, bucket_bytes: int
             ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive parameters in buckets of at most ``bucket_bytes`` full-size bytes in ``dtype`` (a larger
    parameter alone); a parameter that is not row-sharded (a plain tensor, another layout) is a bucket of its own."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, param in params:
        nbytes = param.numel() * itemsize
        joins = (bucket and _row_sharded(param) and size + nbytes <= bucket_bytes
                 and param.device_mesh == bucket[0][1].device_mesh)
        if bucket and not joins:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, param))
        size += nbytes
        if not _row_sharded(param):
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def _gather_bucket(bucket: list[tuple[str, torch.Tensor]], dtype: torch.dtype, stats: WeightSyncStats
                   ) -> list[tuple[str, torch.Tensor]]:
    """The full tensors (in ``dtype``) of one bucket, from one all-gather of its shards cast to ``dtype``.

    FSDP2 shards dim 0 as ``torch.chunk`` does: rank r holds rows [r * c, min((r + 1) * c, n)) with
    c = ceil(n / world), possibly none; each shard is padded to c rows so that every rank sends the same layout.
    """
    first = bucket[0][1]
    if not _row_sharded(first):
        return [(name, param.detach().to(dtype)) for name, param in bucket]
    mesh = first.device_mesh
    world = mesh.size()
    pieces, layouts = [], []
    for name, param in bucket:
        local = param.to_local().detach()
        rows = -(-param.shape[0] // world)
        padded = local.new_zeros((rows, *param.shape[1:]), dtype=dtype)
        padded[: local.shape[0]] = local
        pieces.append(padded.reshape(-1))
        layouts.append((name, rows, tuple(param.shape)))
    send = torch.cat(pieces)
    gathered = send.new_empty(world * send.numel())
    _ALL_GATHER(gathered, send, group=mesh.get_group())
    stats.gathers += 1
    per_rank = gathered.view(world, send.numel())
    full, offset = [], 0
    for name, rows, shape in layouts:
        numel = rows * math.prod(shape[1:])
        stacked = per_rank[:, offset: offset + numel].reshape(world * rows, *shape[1:])
        full.append((name, stacked[: shape[0]].contiguous()))
        offset += numel
    return full


def _counted(name: str, tensor: torch.Tensor, stats: WeightSyncStats) -> tuple[str, torch.Tensor]:
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
