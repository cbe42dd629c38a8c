"""`python -m bench.learning --simulator llm --judge scripted` end to end on the CPU, at toy sizes: the agent trains
against the tiny LLM simulator (the quick recipe's, served by vLLM's OpenAI server) and validates under it and the
scripted persona; the record's per-judge CRs, exploitation gap and the judge's pairing are recounted from the
rollout log. Needs the vLLM environment (`make vllm-env`); run with its python."""
from __future__ import annotations

import importlib.util
import json

import pytest

from bench.learning import main, read_jsonl
from tests.helpers.judges import completion_rate
from tests.helpers.llm_simulator import quick_simulator_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.extended,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="needs vLLM: run with the vLLM environment's python (make vllm-env)")]

TEST_SAMPLES = 4


def test_training_against_the_llm_simulator_judged_by_the_persona(warm_model_path, tmp_path):
    out = tmp_path / "learning.json"
    main(["--simulator", "llm", "--simulator-dir", str(quick_simulator_model()), "--judge", "scripted",
          "--warm-model", warm_model_path, "--steps", "1", "--test-freq", "1", "--prompts-per-step", "2",
          "--group-size", "2", "--ppo-mini-prompts", "2", "--train-samples", "4", "--test-samples", str(TEST_SAMPLES),
          "--max-turns", "4", "--sim-instances", "1", "--work-dir", str(tmp_path / "work"), "--out", str(out)])
    record = json.loads(out.read_text())
    logged = read_jsonl(tmp_path / "work" / "rollouts.jsonl")
    assert [p["step"] for p in record["val_curve"]] == [0, 1]
    for point in record["val_curve"]:
        val = [line for line in logged if line["split"] == "val" and line["step"] == point["step"]]
        judged = [line for line in logged if line["split"] == "val@scripted" and line["step"] == point["step"]]
        assert len(val) == len(judged) == TEST_SAMPLES
        assert point["completion_rate"] == pytest.approx(completion_rate(val))
        assert point["judge_completion_rate"] == pytest.approx(completion_rate(judged))
        assert point["exploitation_gap"] == pytest.approx(completion_rate(val) - completion_rate(judged))
    judged_outcomes = {step: sorted(line["outcome"] == "completed" for line in logged
                                    if line["split"] == "val@scripted" and line["step"] == step) for step in (0, 1)}
    paired = record["judge_paired"]
    assert paired["n"] == TEST_SAMPLES and paired["gained"] - paired["lost"] == sum(judged_outcomes[1]) - sum(
        judged_outcomes[0])
    assert (paired["completed_before"], paired["completed_after"]) == (sum(judged_outcomes[0]), sum(judged_outcomes[1]))
    train = [line for line in logged if line["split"] == "train"]
    assert len(train) == 2 * 2 and any(t["user_source"] == "simulator" for line in train for t in line["turns"])
    # the client's request count and the cache's share (the trainer's metrics) against the dialogues' own counts:
    # every request a dialogue made, plus the client's transport retries
    step = record["train_steps"][0]
    requests, hits = sum(line["sim_requests"] for line in train), sum(line["cache_hits"] for line in train)
    retries = next(m["user_sim/retries"] for m in read_jsonl(tmp_path / "work" / "logs" / "metrics.jsonl")
                   if m.get("step") == 1 and "user_sim/retries" in m)
    assert requests > 0 and step["sim_requests"] == requests + retries
    user_turns = sum(t["user_source"] in ("simulator", "cache") for line in train for t in line["turns"])
    assert step["cache_hit_rate"] == pytest.approx(hits / user_turns)
