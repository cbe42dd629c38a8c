"""The async rollout loop (fast): the same seeded batch in sync and async mode gives the same dialogues (tokens,
masks, outcomes, records, rewards) with deterministic agents and simulators, including format errors,
re-requested malformed replies, simulator failures, truncation and the controller's profiles; dialogues do not
wait for each other; pacing metrics; config checks."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from llm_agent.generation import LLMGenerationManager
from llm_agent.reward import compute_reward
from llm_agent.rollout.config import ConfigError, GenerationConfig
from llm_agent.stand_ins.inprocess_user_sim import InProcessUserSim
from llm_agent.stand_ins.scripted_policy import ScriptedPolicyWorkerGroup
from llm_agent.user_sim.client import TurnReply

from tests.helpers.gen_loop_helpers import column, FAIL, ProgrammedPolicy, ProgrammedSim, agent_text, make_gen_batch
from tests.helpers.repo import SCENARIO_PATH

TENSORS = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask",
           "agent_turn_ids")
RECORDS = ("uid", "dialogue_id", "profile", "outcome", "num_turns", "turns", "messages", "cache_hits",
           "format_errors", "sim_retries", "error")


def config(mode, **overrides):
    cfg = {"scenario": str(SCENARIO_PATH), "mode": mode, "max_turns": 8, "max_tokens_per_turn": 256,
           "max_response_length": 3072, "cache": {"enabled": False}, "controller": {"enabled": True, "seed": 5},
           "async_rollout": {"batch_wait_ms": 2.0, "max_batch_size": 5}}
    cfg.update(overrides)
    return cfg


class OnceMalformedSim(ProgrammedSim):
    """ProgrammedSim whose first answer to each turn of dialogue `retry` lacks the reply tag."""

    def __init__(self, scenario, scripts) -> None:
        super().__init__(scenario, scripts)
        self.seen: set[tuple[str, int]] = set()

    def complete(self, requests):
        results = super().complete(requests)
        for i, req in enumerate(requests):
            turn = (req.dialogue_id, len(req.messages))
            if req.dialogue_id.startswith("retry") and turn not in self.seen:
                self.seen.add(turn)
                results[i] = TurnReply(req.dialogue_id, "no reply tag here", "fake:0", 0.0, 1)
        return results


def assert_same_rollout(sync_out, async_out, scenario):
    for key in TENSORS:
        assert torch.equal(sync_out.batch[key], async_out.batch[key]), key
    for key in RECORDS:
        assert column(sync_out, key) == column(async_out, key), key
    rewards = [compute_reward(out, None, scenario=str(SCENARIO_PATH))[0] for out in (sync_out, async_out)]
    assert torch.equal(rewards[0], rewards[1])
    assert rewards[0].abs().sum() > 0


def test_scripted_agents_give_identical_dialogues_in_both_modes(tok, scenario):
    """Mixed agent qualities (the scripted agent's turn depends on its whole context) against the scripted
    persona, controller on: same profiles, same tokens, same outcomes and rewards."""
    keys = [f"k{i}" for i in range(6) for _ in range(3)]
    outs = {}
    for mode in ("sync", "async"):
        outs[mode] = []
        for quality in ("good", "evasive"):
            wg = ScriptedPolicyWorkerGroup(tok, scenario, world_size=2, quality=quality)
            loop = LLMGenerationManager(tok, wg, config(mode), is_validation=False,
                                        client=InProcessUserSim(scenario, seed=3))
            outs[mode].append(loop.run_llm_loop(make_gen_batch(tok, scenario, keys, uids=keys)))
    for sync_out, async_out in zip(outs["sync"], outs["async"]):
        assert_same_rollout(sync_out, async_out, scenario)
    outcomes = {o for out in outs["sync"] for o in column(out, "outcome")}
    assert "completed" in outcomes and len(outcomes) >= 2, outcomes


def test_programmed_edge_cases_are_identical_in_both_modes(tok, scenario):
    """Format errors, a re-requested malformed reply, a failed turn (error row), a per-turn cut, a budget
    truncation and a false claim: each dialogue ends the same way, with the same tokens, in both modes."""
    good = agent_text(scenario, "Hello, this is the ad platform.")
    claim = agent_text(scenario, "All done.", status=1)
    scripts = {"fmt": ["no tags at all", good, good], "retry": [good, good], "fail": [good, good],
               "long": ["word " * 400] * 3, "claim": [claim], "ok": [good, good, good]}
    sim_scripts = {"fmt": [("Who?", 0), ("Yes.", 1)], "retry": [("Sure.", 0), ("Done.", 1)],
                   "fail": [FAIL], "long": [], "claim": [("What?", 0)],
                   "ok": [("Hi.", 0), ("Fine.", 0), ("Bye.", -1)]}
    keys = ["fmt", "retry", "fail", "long", "claim", "ok"]
    outs = {}
    for mode in ("sync", "async"):
        loop = LLMGenerationManager(tok, ProgrammedPolicy(tok, scripts), config(
            mode, max_turns=3, max_tokens_per_turn=80, max_response_length=330, controller={"enabled": False}),
            is_validation=True, client=OnceMalformedSim(scenario, sim_scripts))
        outs[mode] = loop.run_llm_loop(make_gen_batch(tok, scenario, keys, meta={"do_sample": False}))
    assert_same_rollout(outs["sync"], outs["async"], scenario)
    got = dict(zip(keys, column(outs["async"], "outcome")))
    assert got == {"fmt": "completed", "retry": "completed", "fail": "error", "long": "truncated",
                   "claim": "agent_ended", "ok": "hung_up"}, got
    assert list(column(outs["async"], "sim_retries")) == [0, 2, 0, 0, 0, 0]


class RecordingPolicy(ProgrammedPolicy):
    """ProgrammedPolicy that records the dialogue keys of every generate call."""

    def __init__(self, tokenizer, scripts) -> None:
        super().__init__(tokenizer, scripts, world_size=1)
        self.batch_keys: list[list[str]] = []

    def generate_sequences(self, data):
        texts = [self.tokenizer.decode(row[mask.bool()].tolist())
                 for row, mask in zip(data.batch["input_ids"], data.batch["attention_mask"])]
        self.batch_keys.append([text.split("[")[1].split("]")[0] for text in texts])
        return super().generate_sequences(data)


class DelayedSim(ProgrammedSim):
    """ProgrammedSim that hosts the async rollout on an event loop of its own and answers there (`run_on_loop`,
    `acomplete`, as UserSimClient): dialogue `slow` is answered after `slow_s`, others at once."""

    def __init__(self, scenario, scripts, slow_s: float) -> None:
        super().__init__(scenario, scripts)
        self.slow_s = slow_s

    def _delay(self, requests) -> float:
        return self.slow_s if any(r.dialogue_id.startswith("slow") for r in requests) else 0.0

    def complete(self, requests):
        time.sleep(self._delay(requests))
        return super().complete(requests)

    def run_on_loop(self, coroutine):
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        try:
            return asyncio.run_coroutine_threadsafe(coroutine, loop).result()
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(5)
            loop.close()

    async def acomplete(self, request):
        await asyncio.sleep(self._delay([request]))
        return ProgrammedSim.complete(self, [request])[0]


def test_a_slow_simulator_turn_does_not_hold_up_the_other_dialogues(tok, scenario):
    """Dialogue `slow` waits 0.25 s for each simulator reply. In sync mode every turn waits for it; in async
    mode the other dialogues run their four turns without it and finish long before it."""
    good = agent_text(scenario, "Hello.")
    keys = ["slow", "f1", "f2", "f3"]
    scripts = {k: [good] * 4 for k in keys}
    replies = {k: [("Ok.", 0)] * 3 + [("Yes.", 1)] for k in keys}
    metrics, batches = {}, {}
    for mode in ("sync", "async"):
        policy = RecordingPolicy(tok, scripts)
        loop = LLMGenerationManager(tok, policy, config(mode, max_turns=4, controller={"enabled": False}),
                                    is_validation=True, client=DelayedSim(scenario, replies, slow_s=0.25))
        out = loop.run_llm_loop(make_gen_batch(tok, scenario, keys))
        assert list(column(out, "outcome")) == ["completed"] * 4
        metrics[mode], batches[mode] = out.meta_info["metrics"], policy.batch_keys
        m = metrics[mode]
        assert m["rollout/generate_batches"] == len(policy.batch_keys) and m["rollout/sim_requests"] == 16
        assert 0 < m["rollout/generate_busy_fraction"] < 1 and 0 < m["rollout/user_sim_busy_fraction"] <= 1
        assert m["rollout/dialogue_time_p50_s"] <= m["rollout/dialogue_time_p95_s"] \
            <= m["rollout/time_to_last_dialogue_s"] + 1e-9
    assert all("slow" in keys for keys in batches["sync"]) and len(batches["sync"]) == 4
    assert any("slow" not in keys for keys in batches["async"]), batches["async"]
    # the fast dialogues' durations (the median of four) no longer include the slow one's waits
    assert metrics["async"]["rollout/dialogue_time_p50_s"] < 0.5 * metrics["sync"]["rollout/dialogue_time_p50_s"]
    assert metrics["sync"]["rollout/dialogue_time_p50_s"] >= 4 * 0.25


def test_engine_error_fails_the_rollout_with_its_message(tok, scenario):
    class Broken(ProgrammedPolicy):
        def generate_sequences(self, data):
            raise RuntimeError("engine exploded")

    loop = LLMGenerationManager(tok, Broken(tok, {}), config("async", controller={"enabled": False}),
                                is_validation=True, client=ProgrammedSim(scenario, {}))
    with pytest.raises(RuntimeError, match="engine exploded"):
        loop.run_llm_loop(make_gen_batch(tok, scenario, ["a", "b"]))


def test_mode_and_async_settings_are_checked():
    with pytest.raises(ConfigError, match=r"rollout_loop.config.mode must be one of \['sync', 'async'\]"):
        GenerationConfig.from_dict(config("asynchronous"))
    with pytest.raises(ConfigError, match=r"rollout_loop\.config\.async_rollout\.wait is not a config key"):
        GenerationConfig.from_dict(config("async", async_rollout={"wait": 1}))
    with pytest.raises(ConfigError, match=r"async_rollout\.max_batch_size=0 is outside \[1, inf\)"):
        GenerationConfig.from_dict(config("async", async_rollout={"max_batch_size": 0}))
    parsed = GenerationConfig.from_dict(config("async"))
    assert parsed.mode == "async" and parsed.async_rollout.batch_wait_ms == 2.0
