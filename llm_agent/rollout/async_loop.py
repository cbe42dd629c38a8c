"""The async rollout loop (`rollout_loop.config.mode: async`): every dialogue is its own task.

A dialogue's agent turn goes to the policy engine (`MicroBatchingEngine`) as soon as its previous user turn is
in, and its simulator request (or cache lookup) goes out as soon as its agent turn is back; no dialogue waits for
another. The turn rules are the sync loop's own (`DialogueTurnsMixin`), applied to one dialogue at a time, so
tokens, loss masks, outcomes, records, cache rules and error handling are the same in both modes. All
dialogues end before `run_dialogues_async` returns: the policy's weights change only between steps.

With `UserSimClient` the dialogue tasks run on the client's own event-loop thread (`run_on_loop`), beside its
HTTP connections, and await each simulator request there (`acomplete`): one loop, no thread hop and no second
thread contending for the GIL per request. The calling thread waits; the blocking `generate_sequences` calls run
in the engine's threads.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tqdm import tqdm

from llm_agent.rollout.async_engine import MicroBatchingEngine, rollout_replicas
from llm_agent.rollout.dialogue import Dialogue, TokenBuffer
from llm_agent.rollout.pacing import BusyMeter
from llm_agent.user_sim.client import ChatRequest

__all__ = ["SimulatorGateway", "run_dialogues_async", "runs_on_client_loop"]


class SimulatorGateway:
    """One simulator request per call, from many dialogue tasks at once.

    With a client that runs the rollout on its own event loop (`run_on_loop` and `acomplete`, as
    `UserSimClient`), every request is awaited right there, concurrently, with no thread hop (routing, retries
    and failover as in the sync loop). Any other client (`complete_batch` only, e.g. the in-process simulator) is
    called with one request at a time from one thread, so it needs no thread safety.
    """

    def __init__(self, client: Any) -> None:
        self.client = client
        self.meter = BusyMeter()
        self._acomplete = client.acomplete if runs_on_client_loop(client) else None
        self._executor = None if self._acomplete else ThreadPoolExecutor(1, thread_name_prefix="user-sim")

    async def complete(self, request: ChatRequest) -> Any:
        """The client's answer (ChatReply or TurnFailure) to `request`."""
        self.meter.begin()
        try:
            if self._executor is None:
                return await self._acomplete(request)
            results = await asyncio.get_running_loop().run_in_executor(self._executor, self.client.complete_batch,
                                                                       [request])
            if len(results) != 1:
                raise RuntimeError(f"the simulator client answered {len(results)} results for 1 request")
            return results[0]
        finally:
            self.meter.end()

    def close(self) -> None:
        """Stop the request thread (if any)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)


def runs_on_client_loop(client: Any) -> bool:
    """True when `client` hosts the async rollout on its own event loop (`run_on_loop` + `acomplete`)."""
    return callable(getattr(client, "run_on_loop", None)) and callable(getattr(client, "acomplete", None))


async def _run_dialogue(manager: Any, d: Dialogue, buffer: TokenBuffer, engine: MicroBatchingEngine,
                        sim: SimulatorGateway, progress: tqdm) -> None:
    """Take `d` from its opening to its outcome, one agent turn and one user turn at a time."""
    await _take_turns(manager, d, buffer, engine, sim)
    progress.update(1)


async def _take_turns(manager: Any, d: Dialogue, buffer: TokenBuffer, engine: MicroBatchingEngine,
                      sim: SimulatorGateway) -> None:
    retries = manager.config.user_sim.reply_retries
    while d.active:
        if d.num_turns >= manager.config.max_turns:
            raise RuntimeError(f"dialogue {d.dialogue_id} has no outcome after {d.num_turns} turns")
        if buffer.remaining(d.row) < 1:
            d.end("truncated")
            break
        ids, _ = await engine.generate(d.dialogue_id, d.row)
        kept, cut = manager._keep_agent_tokens(d, ids, buffer)
        text = manager.tokenizer.decode(kept.tolist(), skip_special_tokens=True)
        agent = manager._agent_output(d, text, cut, buffer)
        if agent is None:
            continue
        for attempt in range(retries + 1):
            result = await sim.complete(manager._sim_request(d, attempt))
            if not manager._take_reply(d, agent, result, attempt, buffer):
                break


async def _run_all(manager: Any, dialogues: list[Dialogue], buffer: TokenBuffer,
                   meta: dict[str, Any]) -> tuple[list[BusyMeter], BusyMeter]:
    settings = manager.config.async_rollout
    engine = MicroBatchingEngine(rollout_replicas(manager.wg),
                                 lambda rows, world_size: manager._generation_call(rows, buffer, meta, world_size),
                                 settings.batch_wait_ms, settings.max_batch_size)
    sim = SimulatorGateway(manager.client)
    engine.start()
    progress = tqdm(total=len(dialogues), desc="dialogues", leave=False)
    try:
        async with asyncio.TaskGroup() as group:
            for d in dialogues:
                group.create_task(_run_dialogue(manager, d, buffer, engine, sim, progress), name=d.dialogue_id)
    except BaseExceptionGroup as failed:  # report the first dialogue's error itself, not the group
        raise failed.exceptions[0] from None
    finally:
        progress.close()
        await engine.close()
        sim.close()
    return engine.meters, sim.meter


def run_dialogues_async(manager: Any, dialogues: list[Dialogue], buffer: TokenBuffer,
                        meta: dict[str, Any]) -> tuple[list[BusyMeter], BusyMeter]:
    """Run every dialogue to its outcome concurrently, on the simulator client's event loop when it has one (no
    thread hop per simulator request), else on a new loop; returns the engine replicas' and the simulator's busy
    meters."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        if runs_on_client_loop(manager.client):
            return manager.client.run_on_loop(_run_all(manager, dialogues, buffer, meta))
        return asyncio.run(_run_all(manager, dialogues, buffer, meta))
    raise RuntimeError("rollout_loop.config.mode=async runs its own event loop; call run_llm_loop from a thread "
                       "with no running event loop")
