"""The sync rollout loop (`rollout_loop.config.mode: sync`, the reference): turn-synchronous scheduling.

Each turn, every active dialogue's context goes into one `generate_sequences` batch of the `RolloutEngine`; each
dialogue's environment takes its sampled turn (`Environment.step`), and the simulator requests of the turn go out as one
`SimulatorClient.complete` call, malformed replies re-requested together, until every dialogue's turn is
complete. A dialogue with a slow simulator reply or a long agent turn holds up every other one, as in the
original. The rules of a turn are the environment's, shared with the async loop.
"""
from __future__ import annotations

from collections.abc import Sequence

from tqdm import tqdm

from llm_agent.envs import Environment
from llm_agent.rollout.generation_call import AgentBatches
from llm_agent.rollout.pacing import BusyMeter
from llm_agent.user_sim.client import SimulatorClient, TurnRequest
from verl.workers.rollout.engine import RolloutEngine

__all__ = ["run_turn_synchronous"]


def run_turn_synchronous(envs: Sequence[Environment], engine: RolloutEngine, batches: AgentBatches,
                         client: SimulatorClient, max_turns: int) -> tuple[list[BusyMeter], BusyMeter]:
    """Run every dialogue to its outcome, one turn of all active dialogues at a time; returns the engine's and the
    simulator's busy meters."""
    busy, sim = BusyMeter(), BusyMeter()
    for _ in tqdm(range(max_turns), desc="dialogue turns", leave=False):
        active = [env for env in envs if env.active]
        if not active:
            break
        call = batches([env.row for env in active], engine.world_size)
        busy.begin(len(active))
        try:
            turns = call.run(engine)
        finally:
            busy.end(len(active))
        pending: list[tuple[Environment, TurnRequest]] = []
        for env, turn in zip(active, turns):
            step = env.step(turn)
            if step.request is not None:
                pending.append((env, step.request))
        while pending:
            pending = _simulator_round(pending, client, sim)
    return [busy], sim


def _simulator_round(pending: list[tuple[Environment, TurnRequest]], client: SimulatorClient,
                     sim: BusyMeter) -> list[tuple[Environment, TurnRequest]]:
    """Send every pending request in one batch and hand each answer to its dialogue; returns the re-requests."""
    requests = [request for _, request in pending]
    sim.begin(len(requests))
    try:
        results = client.complete(requests)
    finally:
        sim.end(len(requests))
    if len(results) != len(requests):
        raise RuntimeError(f"the simulator client answered {len(results)} of {len(requests)} requests")
    again = []
    for (env, _), result in zip(pending, results):
        step = env.answer(result)
        if step.request is not None:
            again.append((env, step.request))
    return again
