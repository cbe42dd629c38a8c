"""Multi-node worker group on a simulated Ray cluster (one head with no CPUs, two 1-CPU worker nodes)."""

from __future__ import annotations

import sys

import pytest
import ray
import torch
import torch.distributed as dist
from ray.cluster_utils import Cluster

from verl.single_controller.base import Dispatch, Worker, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

pytestmark = pytest.mark.slow


class NodeWorker(Worker):
    """Reports its node and all-reduces (rank + 1) over gloo."""

    @register(Dispatch.ONE_TO_ALL)
    def node_and_sum(self) -> tuple[int, str, float]:
        """Return (rank, Ray node id, all-reduced sum of rank + 1)."""
        self.init_distributed()
        value = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(value)
        return self.rank, ray.get_runtime_context().get_node_id(), float(value.item())


@pytest.fixture(scope="module")
def two_node_cluster():
    """A local cluster whose head (the driver's node) has no CPUs, so every worker lands on another node."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.mark.extended  # 30 s measured: make test-extended (CI), out of make test's 20 minutes
def test_one_placement_group_per_node_and_cross_node_all_reduce(two_node_cluster):
    pool = RayResourcePool([1, 1], use_gpu=False, name_prefix="h3_two_nodes")
    try:
        assert pool.world_size == 2 and len(pool.placement_groups) == 2
        group = RayWorkerGroup(pool, RayClassWithInitArgs(NodeWorker), name_prefix="h3_multinode")
        try:
            results = group.node_and_sum()
        finally:
            group.shutdown()
    finally:
        pool.remove()
    assert [rank for rank, _, _ in results] == [0, 1]
    driver_node = ray.get_runtime_context().get_node_id()
    nodes = {node for _, node, _ in results}
    assert len(nodes) == 2 and driver_node not in nodes
    assert [total for _, _, total in results] == [3.0, 3.0]
