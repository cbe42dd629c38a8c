"""Rollout replicas of a worker group: the sets of ranks that can each generate a batch of their own.

With the vLLM rollout every tensor-parallel group holds a whole engine, so a caller (the async rollout loop) may
send each group its own batch and keep a request's prefix on one engine. With the HF rollout, generation is one
collective over every rank's FSDP shard, so the whole group is the only replica.
"""
from __future__ import annotations

from typing import Any

from verl.protocol import DataProto

__all__ = ["RankGroupReplica", "rollout_replicas"]


class RankGroupReplica:
    """One replica: `generate_sequences` sends the whole batch to each of `ranks` and returns the first rank's
    answer (every rank of a TP group returns every row)."""

    world_size = 1  # a replica takes any number of rows: no padding to the group's world size

    def __init__(self, worker_group: Any, ranks: list[int]) -> None:
        self.worker_group, self.ranks = worker_group, list(ranks)

    def generate_sequences(self, batch: DataProto) -> DataProto:
        """Generate every row of `batch` on this replica's ranks."""
        return self.worker_group.execute_ranks_sync("generate_replica_sequences", self.ranks, batch)[0]

    def __repr__(self) -> str:
        return f"RankGroupReplica(ranks={self.ranks})"


def rollout_replicas(worker_group: Any) -> list[Any]:
    """The worker group's rollout replicas: one `RankGroupReplica` per replica index its workers report
    (`rollout_replica_index`), or `[worker_group]` when generation is one collective (an index is None) or the
    group does not say."""
    index_of = getattr(worker_group, "rollout_replica_index", None)
    if not callable(index_of):
        return [worker_group]
    indices = index_of()
    if not indices or any(i is None for i in indices):
        return [worker_group]
    groups: dict[int, list[int]] = {}
    for rank, index in enumerate(indices):
        groups.setdefault(int(index), []).append(rank)
    return [RankGroupReplica(worker_group, ranks) for _, ranks in sorted(groups.items())]
