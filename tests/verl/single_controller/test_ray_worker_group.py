"""Ray worker-group tests: real Ray actors in placement groups, real torch.distributed (gloo) between them."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import ray
import torch
import torch.distributed as dist

from verl.protocol import DataProto, DataProtoFuture
from verl.single_controller.base import Dispatch, Execute, Worker, WorkerGroupError, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

pytestmark = pytest.mark.processes


class EchoWorker(Worker):
    """A worker whose methods expose its rank and environment and exercise every dispatch mode."""

    def __init__(self, offset: int = 0) -> None:
        super().__init__()
        self.offset = offset

    @register(Dispatch.ONE_TO_ALL)
    def whoami(self, tag: str) -> dict:
        """Return this rank's view of the group and its environment."""
        keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM",
                "PYTORCH_CUDA_ALLOC_CONF"]
        return {"rank": self.rank, "world_size": self.world_size, "tag": tag, "pid": os.getpid(), "env": {k: os.environ.get(k) for k in keys}}

    @register(Dispatch.ONE_TO_ALL)
    def describe(self, data: DataProto, options: dict) -> tuple[int, int, list, dict]:
        """Return (rank, rows, uids, options) of a whole batch sent to every rank."""
        return self.rank, len(data), list(data.non_tensor_batch["uid"]), options

    @register(Dispatch.ALL_TO_ALL)
    def add(self, x: int, y: int = 0) -> int:
        """Return x + y + offset (x, y given per rank)."""
        return x + y + self.offset

    @register(Dispatch.RANK_ZERO)
    def rank_zero_value(self, base: int) -> tuple[int, int]:
        """Return (rank, base + offset); only rank 0 runs it."""
        return self.rank, base + self.offset

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def executed_on_rank_zero(self) -> int:
        """Return the rank (ONE_TO_ALL arguments, but executed on rank 0 alone)."""
        return self.rank

    @register(Dispatch.DP_COMPUTE_PROTO)
    def double(self, data: DataProto) -> DataProto:
        """Double `x`, record which rank computed each row, carry `uid` through."""
        n = len(data)
        return DataProto.from_dict(
            tensors={"y": data.batch["x"] * 2, "rank": torch.full((n,), self.rank)},
            non_tensors={"uid": data.non_tensor_batch["uid"]},
            meta_info={"metrics": {"rows_per_rank": n}},
        )

    @register(Dispatch.DP_COMPUTE_METRIC)
    def row_sum(self, data: DataProto) -> float:
        """Return the sum of this rank's chunk of `x`."""
        return float(data.batch["x"].sum())

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce_rank(self) -> float:
        """Join the group's gloo process group and all-reduce (rank + 1)."""
        self.init_distributed()
        value = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(value)
        return float(value.item())

    @register(Dispatch.ONE_TO_ALL)
    def fail_on(self, bad_rank: int) -> int:
        """Raise on `bad_rank`, return the rank elsewhere."""
        if self.rank == bad_rank:
            raise ValueError(f"deliberate failure on rank {self.rank}")
        return self.rank

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def square_later(self, x: int) -> int:
        """Return x * x + rank (non-blocking group method)."""
        return x * x + self.rank

    def plain(self, x: int) -> int:
        """An unregistered method, reachable through execute_all_sync / execute_rank_zero_sync."""
        return x + self.rank


class BrokenWorker(Worker):
    """A worker whose constructor fails on rank 1."""

    def __init__(self) -> None:
        super().__init__()
        if self.rank == 1:
            raise RuntimeError("constructor refuses rank 1")


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray instance for the whole module (8 logical CPUs: the count is only a scheduling resource).

    The worker classes live in this test module, which the Ray worker processes cannot import by name, so they
    are pickled by value.
    """
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def pool(ray_cluster):
    """A 2-slot CPU pool that up to 2 worker groups can share."""
    resource_pool = RayResourcePool([2], use_gpu=False, max_colocate_count=2, name_prefix="h3_test_pool")
    yield resource_pool
    resource_pool.remove()


@pytest.fixture(scope="module")
def group(pool):
    """A 2-rank EchoWorker group (offset 10)."""
    worker_group = RayWorkerGroup(pool, RayClassWithInitArgs(EchoWorker, offset=10), name_prefix="h3_echo")
    yield worker_group
    worker_group.shutdown()


def make_batch(n: int) -> DataProto:
    """Row i holds x = [i, i] and uid 'u{i}'."""
    return DataProto.from_dict(
        tensors={"x": torch.arange(n, dtype=torch.float32).unsqueeze(1).repeat(1, 2)},
        non_tensors={"uid": np.array([f"u{i}" for i in range(n)], dtype=object)},
    )


def test_one_to_all_sets_rank_and_environment(group):
    infos = group.whoami("hello")
    assert group.world_size == 2
    assert [info["rank"] for info in infos] == [0, 1]
    assert {info["tag"] for info in infos} == {"hello"}
    assert len({info["pid"] for info in infos}) == 2
    for rank, info in enumerate(infos):
        env = info["env"]
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == "0"
        assert env["MASTER_ADDR"] == group.master_addr and env["MASTER_PORT"] == str(group.master_port)
        assert env["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS", "1")
        assert env["TOKENIZERS_PARALLELISM"] == "false"


def test_one_to_all_sends_the_same_objects_to_every_rank(group):
    results = group.describe(make_batch(3), options={"k": [1, 2]})
    assert results == [(rank, 3, ["u0", "u1", "u2"], {"k": [1, 2]}) for rank in range(2)]


def test_all_to_all_and_rank_zero(group):
    assert group.add([1, 2], y=[100, 200]) == [111, 212]
    with pytest.raises(ValueError, match="ALL_TO_ALL: positional argument 0 must be a list of world_size=2"):
        group.add(1)
    assert group.rank_zero_value(5) == (0, 15)
    assert group.executed_on_rank_zero() == 0


def test_dp_compute_proto_pads_and_unpads_uneven_batch(group):
    result = group.double(make_batch(5))
    assert len(result) == 5
    torch.testing.assert_close(result.batch["y"], make_batch(5).batch["x"] * 2)
    assert list(result.non_tensor_batch["uid"]) == ["u0", "u1", "u2", "u3", "u4"]
    assert result.batch["rank"].tolist() == [0, 0, 0, 1, 1]
    assert result.meta_info["metrics"] == {"rows_per_rank": [3, 3]}


def test_dp_compute_metric_returns_per_rank_results(group):
    assert group.row_sum(make_batch(4)) == [2.0, 10.0]


def test_execute_helpers_and_non_blocking(group):
    assert group.execute_all_sync("plain", 7) == [7, 8]
    assert ray.get(group.execute_all_async("plain", 1)) == [1, 2]
    assert group.execute_rank_zero_sync("plain", 3) == 3
    pending = group.square_later(4)
    assert isinstance(pending, DataProtoFuture)
    assert pending.get() == [16, 17]
    with pytest.raises(AttributeError, match="has no method 'missing'"):
        group.execute_all_sync("missing")


def test_execute_on_chosen_ranks_only(group):
    assert group.execute_ranks_sync("plain", [1], 7) == [8]
    assert group.execute_ranks_sync("plain", [1, 0], 7) == [8, 7]
    with pytest.raises(ValueError, match=r"ranks \[2\] must be a non-empty subset of 0..1"):
        group.execute_ranks_sync("plain", [2], 1)
    with pytest.raises(WorkerGroupError, match=r"fail_on\(\) failed on rank 1"):
        group.execute_ranks_sync("fail_on", [0, 1], 1)


def test_gloo_all_reduce_across_ranks(group):
    assert group.all_reduce_rank() == [3.0, 3.0]


def test_worker_exception_names_method_and_rank(group):
    with pytest.raises(WorkerGroupError, match=r"fail_on\(\) failed on rank 1: ValueError: .*deliberate failure on rank 1") as info:
        group.fail_on(1)
    assert info.value.rank == 1 and info.value.method == "fail_on"
    assert isinstance(info.value.cause, ValueError)
    assert group.fail_on(-1) == [0, 1]


def test_colocated_groups_share_the_pool_up_to_its_limit(pool, group):
    assert pool.groups_placed == 1
    second = RayWorkerGroup(pool, RayClassWithInitArgs(EchoWorker, offset=1000), name_prefix="h3_echo_second")
    try:
        assert pool.groups_placed == 2
        assert second.add([1, 2]) == [1001, 1002]
        assert group.add([1, 2]) == [11, 12]
        assert second.master_port != group.master_port
        assert second.all_reduce_rank() == [3.0, 3.0]
        assert {info["pid"] for info in second.whoami("x")}.isdisjoint(info["pid"] for info in group.whoami("x"))
        with pytest.raises(RuntimeError, match="already hosts 2 worker group"):
            RayWorkerGroup(pool, RayClassWithInitArgs(EchoWorker), name_prefix="h3_echo_third")
    finally:
        second.shutdown()
    assert pool.groups_placed == 1
    with pytest.raises(RuntimeError, match="was shut down"):
        second.add([1, 2])


def test_constructor_failure_names_rank_and_frees_the_share(pool, group):
    with pytest.raises(WorkerGroupError, match=r"__init__\(\) failed on rank 1") as info:
        RayWorkerGroup(pool, RayClassWithInitArgs(BrokenWorker), name_prefix="h3_broken")
    assert info.value.rank == 1
    assert "constructor refuses rank 1" in str(info.value)
    assert pool.groups_placed == 1


def test_bad_construction_arguments(ray_cluster):
    with pytest.raises(TypeError, match="must be a subclass of verl Worker"):
        RayClassWithInitArgs(dict)
    with pytest.raises(ValueError, match="process_on_nodes must be a non-empty list of positive ints"):
        RayResourcePool([0])


@pytest.mark.slow
def test_the_cuda_allocator_setting_reaches_every_worker(pool, monkeypatch):
    # set after Ray started: only an explicit forward gets it into the worker processes
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    extra = RayWorkerGroup(pool, RayClassWithInitArgs(EchoWorker), name_prefix="h3_alloc_conf")
    try:
        assert [info["env"]["PYTORCH_CUDA_ALLOC_CONF"] for info in extra.whoami("x")] == ["expandable_segments:True"] * 2
    finally:
        extra.shutdown()
