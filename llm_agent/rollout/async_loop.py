"""The async rollout loop (`rollout_loop.config.mode: async`): every dialogue is its own task.

A dialogue's agent turn goes to the policy's `RolloutEngine` (micro-batched per replica by `MicroBatchingEngine`)
as soon as its previous user turn is in, and its simulator request goes out as soon as its agent turn is back; no
dialogue waits for another. The turn
rules are the environment's (`llm_agent.envs`), shared with the sync loop, so tokens, loss masks, outcomes,
records, cache rules and error handling are the same in both modes. All dialogues end before
`run_dialogues_async` returns; the policy's weights change only between steps, except in one-step-off training
(docs/off_policy.md), where an update may land between two agent turns, never inside one.

The dialogue tasks run inside the simulator client's `run_on_loop`: with `UserSimClient` that is the client's own
event-loop thread, beside its HTTP connections, where each task awaits its requests (`acomplete`) with no thread
hop and no second thread contending for the GIL; an in-process simulator runs them on a new loop and answers in
the awaiting task. The calling thread waits; the blocking `generate_sequences` calls run in the engine's threads.
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence

from tqdm import tqdm

from llm_agent.envs import AgentBatches, Environment
from llm_agent.rollout.async_engine import MicroBatchingEngine
from llm_agent.rollout.config import AsyncRolloutConfig
from llm_agent.rollout.pacing import BusyMeter
from llm_agent.user_sim.client import SimulatorClient, TurnRequest, TurnResult
from verl.workers.rollout.engine import RolloutEngine

__all__ = ["SimulatorGateway", "run_dialogues_async"]


class SimulatorGateway:
    """The simulator requests of many dialogue tasks, awaited through the client's `acomplete` and metered."""

    def __init__(self, client: SimulatorClient) -> None:
        self.client = client
        self.meter = BusyMeter()

    async def complete(self, request: TurnRequest) -> TurnResult:
        """The client's answer (TurnReply or TurnFailure) to `request`."""
        self.meter.begin()
        try:
            return await self.client.acomplete(request)
        finally:
            self.meter.end()


async def _run_dialogue(env: Environment, engine: MicroBatchingEngine, sim: SimulatorGateway,
                        progress: tqdm) -> None:
    """Take one dialogue from its opening to its outcome, one agent turn and its answer at a time."""
    while env.active:
        turn = await engine.generate(env.dialogue_id, env.row)
        step = env.step(turn)
        while step.request is not None:
            step = env.answer(await sim.complete(step.request))
    progress.update(1)


async def _run_all(envs: Sequence[Environment], policy: RolloutEngine, batches: AgentBatches,
                   client: SimulatorClient, settings: AsyncRolloutConfig) -> tuple[list[BusyMeter], BusyMeter]:
    engine = MicroBatchingEngine(policy.replicas(), batches, settings.batch_wait_ms, settings.max_batch_size)
    sim = SimulatorGateway(client)
    engine.start()
    progress = tqdm(total=len(envs), desc="dialogues", leave=False)
    try:
        async with asyncio.TaskGroup() as group:
            for env in envs:
                group.create_task(_run_dialogue(env, engine, sim, progress), name=env.dialogue_id)
    except BaseExceptionGroup as failed:  # report the first dialogue's error itself, not the group
        raise failed.exceptions[0] from None
    finally:
        progress.close()
        await engine.close()
    return engine.meters, sim.meter


def run_dialogues_async(envs: Sequence[Environment], policy: RolloutEngine, batches: AgentBatches,
                        client: SimulatorClient, settings: AsyncRolloutConfig) -> tuple[list[BusyMeter], BusyMeter]:
    """Run every dialogue to its outcome concurrently, inside the simulator client's `run_on_loop`; returns the
    engine replicas' and the simulator's busy meters."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return client.run_on_loop(_run_all(envs, policy, batches, client, settings))
    raise RuntimeError("rollout_loop.config.mode=async runs its own event loop; call run_llm_loop from a thread "
                       "with no running event loop")
