"""Training rollouts started ahead (`start_llm_loop`, for `async_training.rollouts_in_flight > 1`): started in order
on one thread and run side by side on others, they give the dialogues the same calls give one after another, and the
end-of-step hook counts each step's dialogues from its batch (scripted agents and the in-process persona: both
deterministic)."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from llm_agent.generation import LLMGenerationManager
from llm_agent.rollout.dialogue_record import records_from_batch
from llm_agent.rollout.outcome import Outcome
from llm_agent.stand_ins.inprocess_user_sim import InProcessUserSim
from llm_agent.stand_ins.scripted_policy import ScriptedPolicyWorkerGroup

from tests.helpers.gen_loop_helpers import column, make_gen_batch
from tests.helpers.repo import SCENARIO_PATH
from tests.llm_agent.rollout.test_async_loop import RECORDS, TENSORS

FAILING = {"a1#0", "b2#1"}  # dialogues whose every simulator turn fails (error outcomes)


def _loop(tok, scenario, mode: str) -> LLMGenerationManager:
    cfg = {"scenario": str(SCENARIO_PATH), "mode": mode, "max_turns": 8, "max_tokens_per_turn": 256,
           "max_response_length": 3072, "cache": {"enabled": False}, "controller": {"enabled": True, "seed": 5},
           "user_sim": {"max_error_rate": 0.9}, "async_rollout": {"batch_wait_ms": 2.0, "max_batch_size": 5}}
    group = ScriptedPolicyWorkerGroup(tok, scenario, world_size=2, quality="evasive")
    return LLMGenerationManager(tok, group, cfg, is_validation=False,
                                client=InProcessUserSim(scenario, seed=3, fail_ids=FAILING))


def _batches(tok, scenario):
    return [make_gen_batch(tok, scenario, keys, uids=keys)
            for keys in ([f"a{i}" for i in range(4) for _ in range(2)], [f"b{i}" for i in range(4) for _ in range(2)])]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_rollouts_started_ahead_and_run_together_give_the_sequential_dialogues(tok, scenario, mode):
    sequential = _loop(tok, scenario, mode)
    expected = [sequential.run_llm_loop(batch) for batch in _batches(tok, scenario)]
    ahead = _loop(tok, scenario, mode)
    runs = [ahead.start_llm_loop(batch) for batch in _batches(tok, scenario)]
    assert ahead.calls == 2  # counted (and the users drawn) when started
    both = threading.Barrier(2, timeout=30)

    def together(run):
        both.wait()  # both rollouts are running before either generates
        return run()

    with ThreadPoolExecutor(2) as pool:
        second = pool.submit(together, runs[1])  # the later-started one first
        first = pool.submit(together, runs[0])
        outs = [first.result(), second.result()]
    for want, got in zip(expected, outs):
        for key in TENSORS:
            assert torch.equal(want.batch[key], got.batch[key]), key
        for key in RECORDS:
            assert column(want, key) == column(got, key), key
    outcomes = {o for out in outs for o in column(out, "outcome")}
    assert {"completed", "error"} <= outcomes, outcomes  # completions and failures both exercised


def test_the_hook_counts_a_started_ahead_rollouts_dialogues_from_its_batch(tok, scenario):
    sequential, ahead = _loop(tok, scenario, "async"), _loop(tok, scenario, "async")
    for step, batch in enumerate(_batches(tok, scenario), start=1):
        want = sequential.on_train_step_end(sequential.run_llm_loop(batch), step)
        out = ahead.start_llm_loop(batch)()
        got = ahead.on_train_step_end(out, step)
        records = records_from_batch(out)
        errors = sum(r.outcome == Outcome.ERROR for r in records)
        assert errors >= 1 and got["user_sim/step_error_rate"] == pytest.approx(errors / len(records))
        compared = [key for key in want if key.startswith(("controller/", "user_sim/step_"))]
        assert len(compared) >= 3 and "dialogue/completion_rate" in want
        for key in compared + ["dialogue/completion_rate"]:
            assert got[key] == pytest.approx(want[key]), key
        assert ahead.controller.state_dict() == sequential.controller.state_dict()


def test_validation_rollouts_are_not_started_ahead(tok, scenario):
    cfg = {"scenario": str(SCENARIO_PATH), "cache": {"enabled": False}}
    loop = LLMGenerationManager(tok, ScriptedPolicyWorkerGroup(tok, scenario, world_size=2), cfg, is_validation=True,
                                client=InProcessUserSim(scenario))
    with pytest.raises(RuntimeError, match="start_llm_loop runs training rollouts"):
        loop.start_llm_loop(_batches(tok, scenario)[0])
