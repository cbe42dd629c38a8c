"""The actor worker group as a rollout engine, and its replicas: the sets of ranks that can each generate a batch
of their own.

:class:`WorkerGroupEngine` is how the driver (the trainer's rollout loop) sees the actor-rollout worker group: a
:class:`~verl.workers.rollout.engine.RolloutEngine` whose ``generate_sequences`` is the group's (one batch, split
over the ranks). With the vLLM rollout every tensor-parallel group holds a whole engine, so a caller (the async
rollout loop) may send each group its own batch (:class:`RankGroupReplica`) and keep a request's prefix on one
engine. With the HF rollout, generation is one collective over every rank's FSDP shard, so the whole group is the
only replica.
"""
from __future__ import annotations

from typing import Any

from verl.protocol import DataProto
from verl.workers.rollout.engine import RolloutEngine

__all__ = ["RankGroupReplica", "WorkerGroupEngine"]


class WorkerGroupEngine(RolloutEngine):
    """The actor-rollout worker group (``ActorRolloutRefWorker`` on every rank) as a rollout engine.

    ``world_size`` is the group's; the workers report the policy version (their actor's updates so far) with each
    generation. The vLLM engines sleep and wake inside the workers, around the training phases.
    """

    def __init__(self, worker_group: Any) -> None:
        self.worker_group = worker_group
        self.world_size = int(worker_group.world_size)

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """The group's generation: ``prompts`` split over the ranks (padded to a multiple of the world size)."""
        return self.worker_group.generate_sequences(prompts)

    def replicas(self) -> list[RolloutEngine]:
        """One :class:`RankGroupReplica` per replica index the workers report, or ``[self]`` when generation is one
        collective over all ranks (the workers report no index)."""
        indices = self.worker_group.rollout_replica_index()
        if not indices or any(i is None for i in indices):
            return [self]
        groups: dict[int, list[int]] = {}
        for rank, index in enumerate(indices):
            groups.setdefault(int(index), []).append(rank)
        return [RankGroupReplica(self.worker_group, ranks) for _, ranks in sorted(groups.items())]

    def __repr__(self) -> str:
        return f"WorkerGroupEngine(world_size={self.world_size})"


class RankGroupReplica(RolloutEngine):
    """One replica: ``generate_sequences`` sends the whole batch to each of ``ranks`` and returns the first rank's
    answer (every rank of a TP group returns every row); it takes any number of rows."""

    def __init__(self, worker_group: Any, ranks: list[int]) -> None:
        self.worker_group, self.ranks = worker_group, list(ranks)

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Generate every row of ``prompts`` on this replica's ranks."""
        return self.worker_group.execute_ranks_sync("generate_replica_sequences", self.ranks, prompts)[0]

    def __repr__(self) -> str:
        return f"RankGroupReplica(ranks={self.ranks})"
