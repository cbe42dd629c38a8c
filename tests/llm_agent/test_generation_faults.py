"""The rollout loop with the scripted policy and the in-process scripted simulator (fast): agent qualities,
injected simulator failures, misbehaving worker groups / clients, and the shipped trainer config."""
from __future__ import annotations

import pytest

from llm_agent.generation import LLMGenerationManager
from llm_agent.rollout.config import GenerationConfig
from llm_agent.stand_ins.scripted_policy import ScriptedPolicyWorkerGroup
from llm_agent.stand_ins.inprocess_user_sim import InProcessUserSim

from tests.helpers.gen_loop_helpers import record_columns, column, ProgrammedPolicy, agent_text, make_gen_batch
from tests.helpers.repo import SCENARIO_PATH


def config(**overrides):
    cfg = {"scenario": str(SCENARIO_PATH), "max_turns": 8, "max_tokens_per_turn": 256, "max_response_length": 3072,
           "cache": {"enabled": False}, "controller": {"enabled": True, "seed": 5}}
    cfg.update(overrides)
    return cfg


def loop_for(tok, scenario, quality="good", sim=None, **overrides):
    wg = ScriptedPolicyWorkerGroup(tok, scenario, world_size=2, quality=quality)
    return LLMGenerationManager(tok, wg, config(**overrides), is_validation=False,
                                client=sim or InProcessUserSim(scenario))


def test_good_agent_completes_and_outcomes_match_transcripts(tok, scenario):
    keys = [f"g{i}" for i in range(4) for _ in range(2)]
    out = loop_for(tok, scenario).run_llm_loop(make_gen_batch(tok, scenario, keys, uids=keys))
    nt = record_columns(out)
    assert "completed" in set(nt["outcome"])
    for i in range(len(out)):
        last = nt["turns"][i][-1]
        assert (nt["outcome"][i] == "completed") == (last["user_status"] == 1)
        assert (nt["outcome"][i] == "hung_up") == (last["user_status"] == -1)
        assert nt["num_turns"][i] == len(nt["turns"][i]) <= 8 and nt["format_errors"][i] == 0


def test_malformed_agent_gets_format_errors_and_never_reaches_the_simulator(tok, scenario):
    sim = InProcessUserSim(scenario)
    out = loop_for(tok, scenario, quality="malformed", sim=sim, max_turns=3).run_llm_loop(
        make_gen_batch(tok, scenario, ["m", "m"]))
    nt = record_columns(out)
    assert list(nt["outcome"]) == ["timeout", "timeout"] and list(nt["format_errors"]) == [3, 3]
    assert sim.stats()["user_sim/turns"] == 0
    assert all(t["user_source"] == "format_error" for turns in nt["turns"] for t in turns)
    assert out.meta_info["metrics"]["rollout/format_error_rate"] == 1.0


def test_a_premature_claim_of_success_is_heard_and_counted_a_false_positive(tok, scenario):
    """The "ender" claims the task done (status 1) on its first turn: the user hears it, has not agreed, and the
    call ends as a false claim (FPR 1), never as a completion."""
    sim = InProcessUserSim(scenario)
    out = loop_for(tok, scenario, quality="ender", sim=sim).run_llm_loop(make_gen_batch(tok, scenario, ["e", "f"]))
    assert list(column(out, "outcome")) == ["agent_ended", "agent_ended"]
    assert list(column(out, "num_turns")) == [1, 1] and sim.stats()["user_sim/turns"] == 2
    assert all(turns[-1]["user_source"] == "simulator" for turns in column(out, "turns"))
    assert out.meta_info["metrics"]["rollout/false_positive_rate"] == 1.0


def test_injected_simulator_failures_hit_only_their_dialogues(tok, scenario):
    sim = InProcessUserSim(scenario, fail_ids={"b#1"})
    out = loop_for(tok, scenario, sim=sim).run_llm_loop(make_gen_batch(tok, scenario, ["a", "a", "b", "b"],
                                                                       uids=["a", "a", "b", "b"]))
    nt = record_columns(out)
    assert [o == "error" for o in nt["outcome"]] == [False, False, False, True]
    assert list(nt["uid"]) == ["a", "a", "b", "b/error/b#1"]
    assert "injected failure" in nt["error"][3] and out.batch["response_mask"][3].sum() == 0
    assert all(out.batch["response_mask"][i].sum() > 0 for i in range(3))


class ShortWorkerGroup(ProgrammedPolicy):
    """Fault: drops the last row of every answer."""

    def generate_sequences(self, data):
        out = super().generate_sequences(data)
        return out.select_idxs(list(range(len(out) - 1)))


class SwappingSim(InProcessUserSim):
    """Fault: answers in reverse order."""

    def complete(self, requests):
        return list(reversed(super().complete(requests)))


def test_misbehaving_worker_group_or_client_fails_loudly(tok, scenario):
    wg = ShortWorkerGroup(tok, {"x": [agent_text(scenario, "Hi.")]}, world_size=1)
    loop = LLMGenerationManager(tok, wg, config(controller={"enabled": False}), is_validation=True,
                                client=InProcessUserSim(scenario))
    with pytest.raises(RuntimeError, match="generate_sequences returned responses"):
        loop.run_llm_loop(make_gen_batch(tok, scenario, ["x", "x"], uids=["x1", "x2"]))
    loop = loop_for(tok, scenario, sim=SwappingSim(scenario))
    with pytest.raises(RuntimeError, match="answered"):
        loop.run_llm_loop(make_gen_batch(tok, scenario, ["p", "q"]))


def test_shipped_sead_trainer_config_is_valid():
    from omegaconf import OmegaConf

    from verl.trainer.config_schema import compose_config

    cfg = compose_config([], config_name="sead_trainer")
    parsed = GenerationConfig.from_dict(OmegaConf.to_container(cfg.rollout_loop.config, resolve=True))
    assert parsed.max_response_length == cfg.data.max_response_length
    assert parsed.cache.stage_hit_rates[0] == 0.9 and parsed.controller.enabled
