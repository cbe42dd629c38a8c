"""Dispatch by data-parallel rank of a named mesh (veRL's `make_nd_compute_dataproto_dispatch_fn`).

Each worker declares, per mesh name, its data-parallel rank and whether its results are collected
(`Worker._register_dispatch_collect_info`; e.g. with tensor parallelism every rank of a TP group shares one
dp rank and only one of them is collected). The dispatch splits every DataProto / TensorDict argument into
dp_size equal chunks and gives each worker the chunk of its dp rank; the collection concatenates, in dp-rank
order, the results of the collected workers. The functions follow veRL's convention (worker group first).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from tensordict import TensorDict

from verl.errors import ContractError
from verl.protocol import DataProto

__all__ = ["make_nd_compute_dataproto_dispatch_fn"]


def _mesh_info(worker_group: Any, mesh_name: str) -> tuple[list[int], list[bool]]:
    """(dp rank of every worker, whether it is collected) for `mesh_name`, queried once and cached on the group."""
    cache = worker_group.__dict__.setdefault("_mesh_info_cache", {})
    if mesh_name not in cache:
        dp_ranks = list(worker_group._query_dispatch_info(mesh_name))
        collect = [bool(flag) for flag in worker_group._query_collect_info(mesh_name)]
        cache[mesh_name] = (dp_ranks, collect)
    return cache[mesh_name]


def _split(value: Any, dp_size: int, where: str) -> list[Any]:
    """`dp_size` equal consecutive chunks of a DataProto or TensorDict."""
    if len(value) % dp_size != 0:
        raise ContractError(f"nd dispatch: {where} has {len(value)} rows, not divisible by the dp size {dp_size}")
    if isinstance(value, DataProto):
        return value.chunk(dp_size)
    size = len(value) // dp_size
    return [value[i * size : (i + 1) * size] for i in range(dp_size)]


def dispatch_nd_compute(mesh_name: str, worker_group: Any, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    """Per-rank lists: worker r gets chunk dp_rank(r) of each DataProto/TensorDict argument, other values as is."""
    dp_ranks, _ = _mesh_info(worker_group, mesh_name)
    dp_size = max(dp_ranks) + 1

    def per_rank(where: str, value: Any) -> list[Any]:
        if isinstance(value, (DataProto, TensorDict)):
            chunks = _split(value, dp_size, where)
            return [chunks[rank] for rank in dp_ranks]
        return [value] * len(dp_ranks)

    rank_args = tuple(per_rank(f"positional argument {i}", a) for i, a in enumerate(args))
    rank_kwargs = {key: per_rank(f"keyword argument {key!r}", v) for key, v in kwargs.items()}
    return rank_args, rank_kwargs


def collect_nd_compute(mesh_name: str, worker_group: Any, outputs: Sequence[Any]) -> Any:
    """The collected workers' results in dp-rank order, concatenated (DataProto or TensorDict) or as a list."""
    dp_ranks, collect = _mesh_info(worker_group, mesh_name)
    picked = sorted(((rank, out) for rank, out, keep in zip(dp_ranks, outputs, collect) if keep), key=lambda p: p[0])
    results = [out for _, out in picked]
    if results and all(isinstance(r, DataProto) for r in results):
        return DataProto.concat(results)
    if results and all(isinstance(r, TensorDict) for r in results):
        return torch.cat(results, dim=0)
    return results


def make_nd_compute_dataproto_dispatch_fn(mesh_name: str) -> dict[str, Any]:
    """`{"dispatch_fn", "collect_fn"}` dispatching by the dp rank each worker registered for `mesh_name`."""
    return {
        "dispatch_fn": partial(dispatch_nd_compute, mesh_name),
        "collect_fn": partial(collect_nd_compute, mesh_name),
    }
