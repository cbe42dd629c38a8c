"""The rollout loop against hostile simulator replies (issue 29, items 2 and 5): lone surrogates reach neither the
tokenizer nor the cache file unclean, and an instance that answers 200 without the tag protocol loses the traffic
while the re-requests of its malformed replies go to the healthy instance."""
from __future__ import annotations

import json

import pytest

from llm_agent.generation import LLMGenerationManager
from llm_agent.stand_ins.scripted_policy import ScriptedPolicyWorkerGroup

from tests.helpers.gen_loop_helpers import column, ProgrammedSim, make_gen_batch
from tests.helpers.hostile_openai import HostileOpenAIServer
from tests.helpers.repo import SCENARIO_PATH

STATE = {"cooperation": 2, "emotion": 2, "trust": 2}


def config(**overrides):
    cfg = {"scenario": str(SCENARIO_PATH), "max_turns": 3, "max_tokens_per_turn": 256, "max_response_length": 3072,
           "cache": {"enabled": False}, "controller": {"enabled": False}}
    cfg.update(overrides)
    return cfg


def test_a_reply_with_lone_surrogates_reaches_tokenizer_and_cache_clean(tok, scenario, tmp_path):
    surrogate = scenario.format_user_output("Fine \ud800 tell me more", STATE, 0)
    sim = ProgrammedSim(scenario, {k: [surrogate] * 3 for k in ("a", "b")})
    cache_path = tmp_path / "cache.jsonl"
    cache = {"path": str(cache_path), "stage_hit_rates": {0: 0.5, 1: 0.5}, "min_bucket_size": 1}
    loop = LLMGenerationManager(tok, ScriptedPolicyWorkerGroup(tok, scenario, world_size=2), config(cache=cache),
                                is_validation=False, client=sim)
    try:
        out = loop.run_llm_loop(make_gen_batch(tok, scenario, ["a", "b"]))
        loop.save_checkpoint(str(tmp_path / "ckpt"))  # the cache snapshot
    finally:
        loop.close()
    replies = [t["user_reply"] for turns in column(out, "turns") for t in turns if t.get("user_reply")]
    assert replies and all("\ufffd" in r and "\ud800" not in r for r in replies)
    stored = [json.loads(line)["reply"] for line in cache_path.read_text(encoding="utf-8").splitlines()]
    assert stored and all(r == "Fine \ufffd tell me more" for r in stored)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_instance_answering_without_tags_loses_the_traffic_and_no_dialogue_errs(tok, scenario, mode):
    tagged = scenario.format_user_output("Okay, go on.", STATE, 0)
    with HostileOpenAIServer("ok", content="Sure, whatever you say.") as bad, \
            HostileOpenAIServer("ok", content=tagged) as good:
        user_sim = {"urls": [bad.url, good.url], "model": "m", "timeout_s": 5}
        loop = LLMGenerationManager(tok, ScriptedPolicyWorkerGroup(tok, scenario, world_size=2),
                                    config(mode=mode, user_sim=user_sim), is_validation=True)
        try:
            keys = [f"k{i}" for i in range(12)]
            out = loop.run_llm_loop(make_gen_batch(tok, scenario, keys, meta={"do_sample": False}))
        finally:
            loop.close()
        total = bad.requests + good.requests
    outcomes = list(column(out, "outcome"))
    assert "error" not in outcomes, outcomes
    # before the fix 66% went there; the first batch splits evenly (nothing is known yet), and on a loaded box the
    # penalty decays between slow rounds (19 of 55 seen), so the bound leaves room above a third
    assert bad.requests <= 0.45 * total, f"{bad.requests} of {total} requests went to the instance without tags"
