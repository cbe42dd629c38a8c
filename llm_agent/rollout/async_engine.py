"""The policy side of the async rollout loop: agent-turn requests from concurrent dialogues, served in batches.

Each dialogue task asks for its next agent turn with `await engine.generate(dialogue_id, row)`. A replica is a
`RolloutEngine` of the policy's `replicas()` (the whole FSDP worker group for the HF rollout, whose generation is
one collective over all ranks; each vLLM tensor-parallel group otherwise: see `verl.workers.rollout.replicas`). Per
replica, one batch is in flight at a time: requests wait in the replica's queue until
it is free and then for at most `batch_wait_ms` after the oldest queued request (or until `max_batch_size`
requests are queued), so requests that arrive while a batch generates go out together the moment it returns (the
call-level analogue of continuous batching). A dialogue is placed on the replica with the fewest requests queued
or in flight at its first request and stays there, so its growing prefix stays in that replica's prefix cache.
The blocking `generate_sequences` calls run in a thread per replica; the batches are built from the token
buffer on the event loop, where every dialogue appends its own tokens.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from llm_agent.rollout.pacing import BusyMeter
from verl.workers.rollout.engine import RolloutEngine, SampledTurn, TurnBatch

__all__ = ["MicroBatchingEngine"]


@dataclass
class _Request:
    row: int
    future: asyncio.Future
    queued_at: float = field(default_factory=time.monotonic)


class MicroBatchingEngine:
    """Batches concurrent agent-turn requests per replica; see the module docstring.

    `build_call(rows, world_size)` makes the `TurnBatch` of some buffer rows (on the event loop); the chosen
    replica generates it in that replica's thread.
    """

    def __init__(self, replicas: Sequence[RolloutEngine], build_call: Callable[[list[int], int], TurnBatch],
                 batch_wait_ms: float, max_batch_size: int) -> None:
        if not replicas:
            raise ValueError("MicroBatchingEngine needs at least one replica")
        self.replicas = list(replicas)
        self.build_call = build_call
        self.batch_wait_s = batch_wait_ms / 1000.0
        self.max_batch_size = max_batch_size
        self.meters = [BusyMeter() for _ in self.replicas]
        self._queues: list[list[_Request]] = [[] for _ in self.replicas]
        self._load = [0] * len(self.replicas)  # requests queued or in flight per replica
        self._placement: dict[str, int] = {}
        self._wakeups = [asyncio.Event() for _ in self.replicas]
        self._full = [asyncio.Event() for _ in self.replicas]
        self._executor = ThreadPoolExecutor(max_workers=len(self.replicas), thread_name_prefix="rollout-generate")
        self._workers: list[asyncio.Task] = []

    def start(self) -> None:
        """Start one batching task per replica (call inside the running event loop)."""
        self._workers = [asyncio.create_task(self._serve(i), name=f"generate-replica-{i}")
                         for i in range(len(self.replicas))]

    async def close(self) -> None:
        """Stop the batching tasks and the threads (requests still queued are cancelled)."""
        for task in self._workers:
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        for queue in self._queues:
            for request in queue:
                request.future.cancel()
        self._executor.shutdown(wait=True)

    def replica_of(self, dialogue_id: str) -> int:
        """The replica `dialogue_id` is placed on (assigned by load at its first request)."""
        if dialogue_id not in self._placement:
            self._placement[dialogue_id] = min(range(len(self.replicas)), key=lambda i: (self._load[i], i))
        return self._placement[dialogue_id]

    async def generate(self, dialogue_id: str, row: int) -> SampledTurn:
        """The next agent turn of buffer row `row` (its sampled ids and, when computed, their log-probs)."""
        index = self.replica_of(dialogue_id)
        request = _Request(row, asyncio.get_running_loop().create_future())
        self._queues[index].append(request)
        self._load[index] += 1
        self._wakeups[index].set()
        if len(self._queues[index]) >= self.max_batch_size:
            self._full[index].set()
        try:
            return await request.future
        finally:
            self._load[index] -= 1

    async def _serve(self, index: int) -> None:
        """Send replica `index`'s queued requests in batches, one batch in flight at a time."""
        queue, wakeup, full = self._queues[index], self._wakeups[index], self._full[index]
        loop = asyncio.get_running_loop()
        replica = self.replicas[index]
        while True:
            await wakeup.wait()
            wait_s = queue[0].queued_at + self.batch_wait_s - time.monotonic()
            if wait_s > 0 and len(queue) < self.max_batch_size:
                try:
                    await asyncio.wait_for(full.wait(), wait_s)
                except TimeoutError:
                    pass
            taken = [r for r in queue[:self.max_batch_size] if not r.future.cancelled()]
            del queue[:self.max_batch_size]
            if len(queue) < self.max_batch_size:
                full.clear()
            if not queue:
                wakeup.clear()
            if not taken:
                continue
            try:
                call = self.build_call([r.row for r in taken], replica.world_size)
                self.meters[index].begin(len(taken))
                try:
                    turns = await loop.run_in_executor(self._executor, call.run, replica)
                finally:
                    self.meters[index].end(len(taken))
            except Exception as exc:  # every dialogue of the batch fails with the engine's error
                for request in taken:
                    if not request.future.done():
                        request.future.set_exception(exc)
                continue
            for request, turn in zip(taken, turns):
                if not request.future.done():
                    request.future.set_result(turn)
