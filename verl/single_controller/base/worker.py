"""`Worker`: the base class of every class a worker group runs, one instance per rank.

The worker group starts each worker process with its place in the group in the environment (the torchrun
names): `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`. `Worker.__init__` reads and checks
them; it does not start torch.distributed, which the subclasses do when they need it, via `init_distributed()`
(the FSDP workers call it before building their device mesh).

For dispatch by mesh (`make_nd_compute_dataproto_dispatch_fn`) a worker records, per mesh name, its
data-parallel rank and whether its results are collected (`_register_dispatch_collect_info`); a worker hosting
several roles copies another's records (`get_dispatch_collect` / `set_dispatch_collect`). veRL's names.
"""

from __future__ import annotations

import logging
import os
import random
import socket
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from verl.errors import ContractError
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils.device import get_dist_backend

__all__ = ["Worker", "get_free_port", "get_node_ip"]

logger = logging.getLogger(__name__)


def ephemeral_port_range() -> tuple[int, int]:
    """The ports the kernel picks for port-0 binds and outgoing connections (Linux's ip_local_port_range)."""
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def get_free_port() -> int:
    """Return a TCP port that is free on this machine right now, drawn below the kernel's ephemeral range: the
    port is released before the rendezvous binds it, and an ephemeral one could meanwhile become the source port of
    any outgoing connection (EADDRINUSE under load); a port-0 bind only when no drawn port is free."""
    low = ephemeral_port_range()[0]
    draw = random.SystemRandom()  # not the seeded global generator: parallel runs must not draw alike
    for _ in range(64) if low > 10_000 else ():
        port = draw.randrange(10_000, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def get_node_ip() -> str:
    """Return this node's IP address as Ray sees it (reachable from the other nodes of the cluster)."""
    import ray  # a worker runs without Ray too (standalone, one process): only the group's rendezvous needs it

    return ray.util.get_node_ip_address()


def _int_env(name: str, default: int, minimum: int) -> int:
    """Read the integer environment variable `name` (default if unset); raise naming it if it is invalid."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"environment variable {name}={value} must be >= {minimum}")
    return value


class Worker:
    """Base class of the workers run by a worker group; knows its rank and the group's rendezvous point.

    Read from the environment at construction (defaults give a standalone single-process worker):
    `RANK` (0), `WORLD_SIZE` (1), `LOCAL_RANK` (0), `MASTER_ADDR`, `MASTER_PORT` (unset: `init_distributed`
    then only works for a world size of 1, on a free local port).
    """

    def __init__(self) -> None:
        self._world_size = _int_env("WORLD_SIZE", default=1, minimum=1)
        self._rank = _int_env("RANK", default=0, minimum=0)
        self._local_rank = _int_env("LOCAL_RANK", default=0, minimum=0)
        if self._rank >= self._world_size:
            raise ValueError(f"environment variable RANK={self._rank} must be < WORLD_SIZE={self._world_size}")
        self._master_addr = os.environ.get("MASTER_ADDR") or None
        port = os.environ.get("MASTER_PORT")
        self._master_port = _int_env("MASTER_PORT", default=0, minimum=1) if port else None
        self._dispatch_dp_rank: dict[str, int] = {}
        self._collect_dp_rank: dict[str, bool] = {}

    def _register_dispatch_collect_info(self, mesh_name: str, dp_rank: int, is_collect: bool) -> None:
        """Record this worker's data-parallel rank in mesh `mesh_name` and whether its results are collected."""
        if mesh_name in self._dispatch_dp_rank:
            raise ContractError(f"mesh_name {mesh_name!r} is already registered on {type(self).__name__}")
        if not isinstance(dp_rank, int) or dp_rank < 0:
            raise ContractError(f"dp_rank must be a non-negative int, got {dp_rank!r}")
        self._dispatch_dp_rank[mesh_name] = dp_rank
        self._collect_dp_rank[mesh_name] = bool(is_collect)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_dispatch_info(self, mesh_name: str) -> int:
        """This worker's data-parallel rank in mesh `mesh_name` (bound on the group: one per rank)."""
        if mesh_name not in self._dispatch_dp_rank:
            raise ContractError(f"mesh {mesh_name!r} is not registered on {type(self).__name__}; "
                                f"registered: {sorted(self._dispatch_dp_rank)}")
        return self._dispatch_dp_rank[mesh_name]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_collect_info(self, mesh_name: str) -> bool:
        """Whether this worker's results are collected for mesh `mesh_name` (bound on the group: one per rank)."""
        if mesh_name not in self._collect_dp_rank:
            raise ContractError(f"mesh {mesh_name!r} is not registered on {type(self).__name__}; "
                                f"registered: {sorted(self._collect_dp_rank)}")
        return self._collect_dp_rank[mesh_name]

    def get_dispatch_collect(self) -> dict[str, dict]:
        """`{"dispatch_dp_rank": {mesh: dp_rank}, "collect_dp_rank": {mesh: is_collect}}` (copies)."""
        return {"dispatch_dp_rank": dict(self._dispatch_dp_rank), "collect_dp_rank": dict(self._collect_dp_rank)}

    def set_dispatch_collect(
        self, mesh_name: str, dispatch_dp_rank: dict[str, int], collect_dp_rank: dict[str, bool]
    ) -> None:
        """Record under `mesh_name` the single mesh entry of another worker's `get_dispatch_collect()`."""
        if mesh_name in self._dispatch_dp_rank:
            raise ContractError(f"mesh_name {mesh_name!r} is already registered: {sorted(self._dispatch_dp_rank)}")
        if len(dispatch_dp_rank) != 1 or len(collect_dp_rank) != 1:
            raise ContractError("set_dispatch_collect: expects the records of exactly one mesh, got "
                                f"{sorted(dispatch_dp_rank)} / {sorted(collect_dp_rank)}")
        self._dispatch_dp_rank[mesh_name] = next(iter(dispatch_dp_rank.values()))
        self._collect_dp_rank[mesh_name] = bool(next(iter(collect_dp_rank.values())))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self._rank}, world_size={self._world_size})"

    @property
    def rank(self) -> int:
        """This worker's global rank in its group (0-based)."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of workers in the group."""
        return self._world_size

    @property
    def local_rank(self) -> int:
        """This worker's rank on its node (0 for one actor per GPU, which sees only its own GPU)."""
        return self._local_rank

    @property
    def master_addr(self) -> str | None:
        """Address of the torch.distributed rendezvous (rank 0's node), or None if not set."""
        return self._master_addr

    @property
    def master_port(self) -> int | None:
        """Port of the torch.distributed rendezvous, or None if not set."""
        return self._master_port

    def get_node_ip_and_free_port(self) -> tuple[str, int]:
        """Return this worker's node IP and a port free on that node."""
        return get_node_ip(), get_free_port()

    def init_distributed(self, timeout_s: float = 600.0) -> None:
        """Join the group's torch.distributed process group (nccl on CUDA, gloo on CPU); no-op if already joined.

        On CUDA the current device is set to `local_rank` first. Raises if the process is already in a process
        group of a different size, or if the rendezvous address is missing for a world size above 1.
        """
        if dist.is_initialized():
            if dist.get_world_size() != self._world_size or dist.get_rank() != self._rank:
                raise RuntimeError(
                    f"torch.distributed is already initialised as rank {dist.get_rank()} of {dist.get_world_size()}, "
                    f"but this worker is rank {self._rank} of {self._world_size}"
                )
            return
        addr, port = self._master_addr, self._master_port
        if addr is None or port is None:
            if self._world_size > 1:
                raise RuntimeError(
                    f"rank {self._rank} of {self._world_size}: MASTER_ADDR/MASTER_PORT are not set in the environment; "
                    "start workers through a worker group (or set them as for torchrun)"
                )
            addr, port = "127.0.0.1", get_free_port()
        backend = get_dist_backend()
        if backend == "nccl":
            torch.cuda.set_device(self._local_rank)
        logger.info("rank %d/%d joining %s process group at %s:%d", self._rank, self._world_size, backend, addr, port)
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{addr}:{port}",
            rank=self._rank,
            world_size=self._world_size,
            timeout=timedelta(seconds=timeout_s),
        )
