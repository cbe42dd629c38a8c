"""Ray implementation of the single controller: resource pools (placement groups) and worker groups (actors).

`RayResourcePool` reserves one placement group per node, one bundle per worker slot. `RayWorkerGroup` starts
one Ray actor per bundle running the worker class, with its rank and the torch.distributed rendezvous in the
environment, and exposes the class's `@register`ed methods. Up to `max_colocate_count` worker groups (e.g. the
actor and the critic) share a pool: each actor asks for `1 / max_colocate_count` of its bundle.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections import Counter
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from verl.single_controller.base.worker import Worker, get_free_port, get_node_ip
from verl.single_controller.base.worker_group import WorkerGroup, WorkerGroupError

__all__ = ["RayClassWithInitArgs", "RayResourcePool", "RayWorkerGroup"]

logger = logging.getLogger(__name__)

# Driver environment variables every worker gets as well (they must be set before CUDA initialises, and a
# worker of an already running Ray cluster does not inherit the driver's environment).
FORWARDED_ENV = ("PYTORCH_CUDA_ALLOC_CONF",)


class RayResourcePool:
    """Placement groups holding the worker slots: `process_on_nodes[i]` slots on node `i`, one bundle each.

    A slot is `{"CPU": 1}`, or `{"CPU": 1, "GPU": 1}` with `use_gpu`. Each node's bundles form one placement group
    (strategy PACK on CPU, STRICT_PACK on GPU, so a node's GPUs are on one machine). Ranks are numbered node by
    node, bundle by bundle. Creation waits until the groups are placed, raising after `ready_timeout_s`.
    """

    def __init__(
        self,
        process_on_nodes: Sequence[int],
        use_gpu: bool = False,
        max_colocate_count: int = 1,
        name_prefix: str = "",
        ready_timeout_s: float = 120.0,
    ) -> None:
        if not ray.is_initialized():
            raise RuntimeError("RayResourcePool: Ray is not initialised; call ray.init() first")
        counts = list(process_on_nodes)
        if not counts or any(not isinstance(n, int) or n < 1 for n in counts):
            raise ValueError(f"RayResourcePool: process_on_nodes must be a non-empty list of positive ints, got {counts!r}")
        if not isinstance(max_colocate_count, int) or max_colocate_count < 1:
            raise ValueError(f"RayResourcePool: max_colocate_count must be a positive int, got {max_colocate_count!r}")
        self.process_on_nodes = counts
        self.use_gpu = bool(use_gpu)
        self.max_colocate_count = max_colocate_count
        self.name_prefix = name_prefix or f"pool_{uuid.uuid4().hex[:6]}"
        self._groups_placed = 0
        bundle = {"CPU": 1.0, "GPU": 1.0} if self.use_gpu else {"CPU": 1.0}
        strategy = "STRICT_PACK" if self.use_gpu else "PACK"
        self.placement_groups: list[PlacementGroup] = [
            placement_group([dict(bundle) for _ in range(n)], strategy=strategy, name=f"{self.name_prefix}_node{i}")
            for i, n in enumerate(counts)
        ]
        try:
            ray.get([pg.ready() for pg in self.placement_groups], timeout=ready_timeout_s)
        except GetTimeoutError:
            self.remove()
            raise RuntimeError(
                f"RayResourcePool {self.name_prefix!r}: placement groups {counts} x {bundle} could not be placed within "
                f"{ready_timeout_s:.0f}s; available cluster resources: {ray.available_resources()}"
            ) from None

    @property
    def world_size(self) -> int:
        """Total number of worker slots (ranks) in the pool."""
        return sum(self.process_on_nodes)

    def slots(self) -> list[tuple[PlacementGroup, int]]:
        """Return `(placement_group, bundle_index)` for every rank, in rank order."""
        return [(pg, i) for pg, n in zip(self.placement_groups, self.process_on_nodes) for i in range(n)]

    @property
    def groups_placed(self) -> int:
        """How many worker groups currently hold a colocation share of this pool."""
        return self._groups_placed

    def acquire(self, group_name: str) -> None:
        """Reserve a colocation share of every slot for a worker group; raise if `max_colocate_count` are placed."""
        if not self.placement_groups:
            raise RuntimeError(f"RayResourcePool {self.name_prefix!r} was removed; create a new pool")
        if self._groups_placed >= self.max_colocate_count:
            raise RuntimeError(
                f"RayResourcePool {self.name_prefix!r} already hosts {self._groups_placed} worker group(s) "
                f"= max_colocate_count; cannot place {group_name!r} (raise max_colocate_count to colocate more)"
            )
        self._groups_placed += 1

    def release(self) -> None:
        """Give back a colocation share taken by `acquire` (called by a worker group's shutdown)."""
        self._groups_placed = max(0, self._groups_placed - 1)

    def remove(self) -> None:
        """Remove the placement groups (actors still inside them are killed by Ray). Idempotent."""
        for pg in self.placement_groups:
            remove_placement_group(pg)
        self.placement_groups = []


class RayClassWithInitArgs:
    """A `Worker` subclass together with the arguments for its constructor, instantiated once per rank.

    `cls` may also be the class wrapped by `@ray.remote` (as veRL's examples write it); the class inside is used.
    """

    def __init__(self, cls: type, *args: Any, **kwargs: Any) -> None:
        cls = getattr(cls, "__ray_actor_class__", cls)
        if not isinstance(cls, type) or not issubclass(cls, Worker):
            raise TypeError(f"RayClassWithInitArgs: cls must be a subclass of verl Worker, got {cls!r}")
        self.cls = cls
        self.args = args
        self.kwargs = kwargs


@ray.remote(num_cpus=0)
def _node_ip_and_free_port() -> tuple[str, int]:
    """Return the IP of the node this task runs on and a port free there (the rendezvous of a new group)."""
    return get_node_ip(), get_free_port()


def _rendezvous_on(pg: PlacementGroup, bundle_index: int) -> tuple[str, int]:
    """Return the IP of the node holding a bundle and a port free there (on the driver itself when it is that node)."""
    node_id = ray.util.placement_group_table(pg)["bundles_to_node_id"][bundle_index]
    if node_id == ray.get_runtime_context().get_node_id():
        return get_node_ip(), get_free_port()
    probe = _node_ip_and_free_port.options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle_index)
    )
    return ray.get(probe.remote())


_INLINE_TYPES = (bool, int, float, complex, str, bytes, type(None), ray.ObjectRef)


def _share_repeated_args(calls: Sequence[tuple[tuple, dict]]) -> list[tuple[tuple, dict]]:
    """Replace every non-scalar argument object that occurs in several calls by one shared `ray.put` reference.

    Ray resolves top-level ObjectRef arguments before the method runs, so the workers see the same values.
    """
    seen = Counter(id(value) for args, kwargs in calls for value in (*args, *kwargs.values()))
    refs: dict[int, ray.ObjectRef] = {}

    def share(value: Any) -> Any:
        if seen[id(value)] < 2 or isinstance(value, _INLINE_TYPES):
            return value
        if id(value) not in refs:
            refs[id(value)] = ray.put(value)
        return refs[id(value)]

    return [(tuple(share(v) for v in args), {k: share(v) for k, v in kwargs.items()}) for args, kwargs in calls]


class RayWorkerGroup(WorkerGroup):
    """One Ray actor per slot of `resource_pool`, running `ray_cls_with_init`; exposes its `@register`ed methods.

    Each actor gets `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (0: one actor per CPU slot or per GPU, which it sees as
    device 0), `MASTER_ADDR`/`MASTER_PORT` (rank 0's node and a port free there), `OMP_NUM_THREADS` (the
    driver's value, else 1) and `TOKENIZERS_PARALLELISM=false`. Construction waits until every actor is built
    and raises `WorkerGroupError` naming the rank whose constructor failed.

    Calls may come from several driver threads (the one-step-off trainer generates on one while it trains on the
    other): a call's tasks are submitted to all its ranks under one lock, so every rank runs the calls in the same
    order and no collective waits on a rank busy with another call.
    """

    def __init__(
        self, resource_pool: RayResourcePool, ray_cls_with_init: RayClassWithInitArgs, name_prefix: str | None = None
    ) -> None:
        if not isinstance(resource_pool, RayResourcePool):
            raise TypeError(f"RayWorkerGroup: resource_pool must be a RayResourcePool, got {type(resource_pool).__name__}")
        if not isinstance(ray_cls_with_init, RayClassWithInitArgs):
            raise TypeError(
                f"RayWorkerGroup: ray_cls_with_init must be a RayClassWithInitArgs, got {type(ray_cls_with_init).__name__}"
            )
        cls = ray_cls_with_init.cls
        super().__init__(name_prefix or f"{cls.__name__}_{uuid.uuid4().hex[:6]}")
        self._submit_lock = threading.Lock()
        self._cls = cls
        self._pool = resource_pool
        self._workers: list[ray.actor.ActorHandle] = []
        self.master_addr: str = ""
        self.master_port: int = 0
        resource_pool.acquire(self.name)
        try:
            self._start_workers(ray_cls_with_init)
        except BaseException:
            self.shutdown()
            raise
        self._bind_worker_methods(cls)

    def _start_workers(self, ray_cls_with_init: RayClassWithInitArgs) -> None:
        """Pick the rendezvous on rank 0's node, create one actor per slot, wait until all are constructed."""
        pool = self._pool
        slots = pool.slots()
        self.master_addr, self.master_port = _rendezvous_on(*slots[0])
        share = 1.0 / pool.max_colocate_count
        remote_cls = ray.remote(self._cls)
        for rank, (pg, bundle_index) in enumerate(slots):
            env_vars = {
                "RANK": str(rank),
                "WORLD_SIZE": str(len(slots)),
                "LOCAL_RANK": "0",
                "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port),
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                "TOKENIZERS_PARALLELISM": "false",
                **{name: os.environ[name] for name in FORWARDED_ENV if name in os.environ},
            }
            actor = remote_cls.options(
                num_cpus=share,
                num_gpus=share if pool.use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle_index),
                runtime_env={"env_vars": env_vars},
            ).remote(*ray_cls_with_init.args, **ray_cls_with_init.kwargs)
            self._workers.append(actor)
        self._wait("__init__", [worker.__ray_ready__.remote() for worker in self._workers])
        logger.info("%s: %d workers up, rendezvous %s:%d", self.name, len(slots), self.master_addr, self.master_port)

    @property
    def world_size(self) -> int:
        """The number of workers (ranks) in the group."""
        return len(self._workers)

    @property
    def workers(self) -> list[ray.actor.ActorHandle]:
        """The Ray actor handles, in rank order."""
        return list(self._workers)

    def _check_method(self, method: str) -> None:
        """Raise if the group was shut down or the worker class has no method `method`."""
        if not self._workers:
            raise RuntimeError(f"{self.name}: the worker group was shut down")
        if not callable(getattr(self._cls, method, None)):
            raise AttributeError(f"{self.name}: worker class {self._cls.__name__} has no method {method!r}")

    def _launch(self, method: str, calls: Sequence[tuple[tuple, dict]]) -> list[ray.ObjectRef]:
        """Call `method` remotely on ranks 0..len(calls)-1 with their `(args, kwargs)`; return the object refs.

        An argument object passed to several ranks (e.g. by ONE_TO_ALL) is put in the object store once and
        shared, instead of being serialized once per rank.
        """
        self._check_method(method)
        calls = _share_repeated_args(calls)
        with self._submit_lock:
            return [getattr(worker, method).remote(*args, **kwargs)
                    for worker, (args, kwargs) in zip(self._workers, calls)]

    def _wait(self, method: str, handles: Sequence[ray.ObjectRef], ranks: Sequence[int] | None = None) -> list[Any]:
        """Return the results in the order of `handles` (ranks 0.. unless `ranks` names them); the first rank to
        fail raises `WorkerGroupError` naming it at once.

        Results are taken as they complete, so a failed rank is reported even while the others block (e.g. in a
        collective waiting for it).
        """
        ranks = list(range(len(handles))) if ranks is None else list(ranks)
        position = {ref: i for i, ref in enumerate(handles)}
        results: dict[int, Any] = {}
        pending = list(handles)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            i = position[ready[0]]
            rank = ranks[i]
            try:
                results[i] = ray.get(ready[0])
            except RayTaskError as err:
                cause = err.cause if isinstance(err.cause, BaseException) else err
                raise WorkerGroupError(self.name, method, rank, cause) from err
            except RayActorError as err:
                raise WorkerGroupError(self.name, method, rank, err) from err
        return [results[i] for i in range(len(handles))]

    def execute_all_async(self, method_name: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """Start `method_name(*args, **kwargs)` on every rank (same arguments); return the object refs.

        Unlike veRL, arguments are never split per rank here; use a method registered ALL_TO_ALL for that.
        """
        return self._launch(method_name, [(args, kwargs)] * self.world_size)

    def wait_all(self, method_name: str, handles: Sequence[ray.ObjectRef]) -> list[Any]:
        """The results of `handles` (from `execute_all_async(method_name, ...)`) in rank order; the first rank to
        fail raises `WorkerGroupError` naming it."""
        return self._wait(method_name, handles)

    def execute_all_sync(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run `method_name(*args, **kwargs)` on every rank (same arguments); return the results in rank order."""
        return self._wait(method_name, self.execute_all_async(method_name, *args, **kwargs))

    def execute_all(self, method_name: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """veRL alias of `execute_all_async`."""
        return self.execute_all_async(method_name, *args, **kwargs)

    def execute_ranks_sync(self, method_name: str, ranks: Sequence[int], *args: Any, **kwargs: Any) -> list[Any]:
        """Run `method_name(*args, **kwargs)` on the given ranks only (same arguments); results in `ranks` order."""
        self._check_method(method_name)
        bad = [r for r in ranks if not 0 <= r < self.world_size]
        if bad or not ranks:
            raise ValueError(f"{self.name}: ranks {list(ranks)} must be a non-empty subset of 0..{self.world_size - 1}")
        shared = _share_repeated_args([(args, kwargs)] * len(ranks))
        with self._submit_lock:
            handles = [getattr(self._workers[r], method_name).remote(*a, **kw) for r, (a, kw) in zip(ranks, shared)]
        return self._wait(method_name, handles, ranks)

    def execute_rank_zero_async(self, method_name: str, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        """Start `method_name(*args, **kwargs)` on rank 0; return its object ref."""
        return self._launch(method_name, [(args, kwargs)])[0]

    def execute_rank_zero_sync(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Run `method_name(*args, **kwargs)` on rank 0 and return its result."""
        return self._wait(method_name, [self.execute_rank_zero_async(method_name, *args, **kwargs)])[0]

    def execute_rank_zero(self, method_name: str, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        """veRL alias of `execute_rank_zero_async`."""
        return self.execute_rank_zero_async(method_name, *args, **kwargs)

    def shutdown(self) -> None:
        """Kill the group's actors and give their share of the resource pool back. Idempotent."""
        if not self._workers and self._pool is None:
            return
        for worker in self._workers:
            ray.kill(worker, no_restart=True)
        self._workers = []
        if self._pool is not None:
            self._pool.release()
            self._pool = None
