"""The async loop's engine (fast): micro-batching window and size cap, sticky placement balanced by load,
errors reaching every request of a failed batch; BusyMeter and pacing metrics against hand-computed values."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from llm_agent.rollout.async_engine import MicroBatchingEngine
from verl.workers.rollout.engine import SampledTurn
from verl.workers.rollout.engine import RolloutEngine
from verl.workers.rollout.replicas import RankGroupReplica, WorkerGroupEngine
from llm_agent.rollout.pacing import BusyMeter, pacing_metrics


class FakeCall:
    """A TurnBatch stand-in: answers row r with the single token r, of log-prob -r/2."""

    def __init__(self, rows: list[int]) -> None:
        self.rows = rows

    def run(self, engine):
        return engine.generate_sequences(self.rows)


class FakeReplica:
    """Records the rows of every batch; each batch takes `seconds` (blocking, as a Ray call does)."""

    world_size = 1

    def __init__(self, seconds: float = 0.0, fail: bool = False) -> None:
        self.seconds, self.fail = seconds, fail
        self.batches: list[list[int]] = []
        self.threads: set[str] = set()

    def generate_sequences(self, rows):
        self.batches.append(list(rows))
        self.threads.add(threading.current_thread().name)
        time.sleep(self.seconds)
        if self.fail:
            raise RuntimeError("replica down")
        return [SampledTurn(torch.tensor([r]), torch.tensor([-0.5 * r])) for r in rows]


async def run_requests(engine, requests, spacing_s=0.0):
    """Send (dialogue id, row) requests `spacing_s` apart; returns the answers in order."""
    engine.start()
    try:
        tasks = []
        for dialogue, row in requests:
            tasks.append(asyncio.create_task(engine.generate(dialogue, row)))
            await asyncio.sleep(spacing_s)
        return await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await engine.close()


def test_requests_within_the_window_share_a_batch_and_the_cap_splits_them():
    replica = FakeReplica(seconds=0.05)
    engine = MicroBatchingEngine([replica], lambda rows, ws: FakeCall(rows), batch_wait_ms=30.0, max_batch_size=3)
    answers = asyncio.run(run_requests(engine, [(f"d{i}", i) for i in range(5)]))
    assert [(int(turn.ids[0]), float(turn.log_probs[0])) for turn in answers] == [(i, -0.5 * i) for i in range(5)]
    assert replica.batches == [[0, 1, 2], [3, 4]]  # cap 3: the rest go out as the next batch
    assert replica.threads and all(name.startswith("rollout-generate") for name in replica.threads)


def test_a_request_arriving_while_a_batch_runs_joins_the_next_one():
    replica = FakeReplica(seconds=0.15)
    engine = MicroBatchingEngine([replica], lambda rows, ws: FakeCall(rows), batch_wait_ms=1.0, max_batch_size=64)
    asyncio.run(run_requests(engine, [("a", 0), ("b", 1), ("c", 2)], spacing_s=0.05))
    assert replica.batches == [[0], [1, 2]]


def test_dialogues_stick_to_the_least_loaded_replica():
    replicas = [FakeReplica(0.02), FakeReplica(0.02)]
    engine = MicroBatchingEngine(replicas, lambda rows, ws: FakeCall(rows), batch_wait_ms=5.0, max_batch_size=64)

    async def scenario():
        engine.start()
        try:
            first = [asyncio.create_task(engine.generate(d, r)) for d, r in (("a", 0), ("b", 1), ("c", 2))]
            await asyncio.gather(*first)
            again = [asyncio.create_task(engine.generate(d, r)) for d, r in (("c", 2), ("a", 0), ("b", 1))]
            await asyncio.gather(*again)
        finally:
            await engine.close()

    asyncio.run(scenario())
    # a -> replica 0, b -> replica 1 (fewer queued), c -> replica 0 (tie, lowest index); then they stay put
    assert {d: engine.replica_of(d) for d in "abc"} == {"a": 0, "b": 1, "c": 0}
    assert sorted(map(sorted, replicas[0].batches)) == [[0, 2], [0, 2]]
    assert replicas[1].batches == [[1], [1]]


def test_a_failed_batch_fails_each_of_its_requests():
    engine = MicroBatchingEngine([FakeReplica(fail=True)], lambda rows, ws: FakeCall(rows), 1.0, 8)
    answers = asyncio.run(run_requests(engine, [("a", 0), ("b", 1)]))
    assert all(isinstance(a, RuntimeError) and "replica down" in str(a) for a in answers)


def test_the_worker_groups_replicas_follow_the_workers_replica_indices():
    class Group:
        world_size = 4

        def __init__(self, indices):
            self.indices, self.calls = indices, []

        def rollout_replica_index(self):
            return self.indices

        def execute_ranks_sync(self, method, ranks, batch):
            self.calls.append((method, list(ranks)))
            return [f"{batch}@{r}" for r in ranks]

    hf = WorkerGroupEngine(Group([None] * 4))
    assert hf.replicas() == [hf] and hf.world_size == 4
    tp2 = Group([0, 0, 1, 1])
    replicas = WorkerGroupEngine(tp2).replicas()
    assert [r.ranks for r in replicas] == [[0, 1], [2, 3]] and all(isinstance(r, RankGroupReplica) for r in replicas)
    assert all(isinstance(r, RolloutEngine) for r in replicas)
    assert replicas[1].generate_sequences("batch") == "batch@2"
    assert tp2.calls == [("generate_replica_sequences", [2, 3])] and replicas[0].world_size == 1


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_busy_meter_and_pacing_metrics_match_a_hand_computed_timeline():
    clock = FakeClock()
    engine, sim = BusyMeter(clock), BusyMeter(clock)
    # engine: 3 rows in flight over [0, 2), 1 row over [5, 6); simulator: 1 over [2, 4), 2 over [3, 4), 0 after
    engine.begin(3); clock.now = 2.0; engine.end(3)  # noqa: E702
    sim.begin(); clock.now = 3.0; sim.begin(); clock.now = 4.0; sim.end(2)  # noqa: E702
    clock.now = 5.0; engine.begin(); clock.now = 6.0; engine.end(); clock.now = 10.0  # noqa: E702
    metrics = pacing_metrics(10.0, [engine], sim, [1.0, 2.0, 3.0, 4.0, 10.0])
    assert metrics["rollout/generate_busy_fraction"] == pytest.approx(3.0 / 10)
    assert metrics["rollout/generate_in_flight_mean"] == pytest.approx((3 * 2 + 1 * 1) / 10)
    assert metrics["rollout/generate_in_flight_max"] == 3 and metrics["rollout/generate_batches"] == 2
    assert metrics["rollout/user_sim_busy_fraction"] == pytest.approx(2.0 / 10)
    assert metrics["rollout/user_sim_in_flight_mean"] == pytest.approx((1 * 1 + 2 * 1) / 10)
    assert metrics["rollout/user_sim_in_flight_max"] == 2
    assert metrics["rollout/dialogue_time_p50_s"] == pytest.approx(3.0)
    assert metrics["rollout/dialogue_time_p95_s"] == pytest.approx(4.0 + 0.8 * 6.0)  # linear between 4 and 10
    with pytest.raises(RuntimeError, match="only 0 in flight"):
        sim.end()
