"""The diagnosis of a scripted run whose failures are known by construction: the "evasive" scripted agent answers
only the doubts of the first third of the scenario's doubt categories and talks past the others, so every call it
loses is lost on a doubt of a skipped category. Through the real rollout loop (in-process scripted simulator), each
lost call must carry `doubt_unanswered` on the doubt it was lost on, and never on an answered category; the calls
it completes carry no label; the loop's records, its rollout log, its per-step label counts and the reward's
`turn_labels` agree."""
from __future__ import annotations

import json
import random

import pytest

from llm_agent.generation import LLMGenerationManager
from llm_agent.reward import compute_reward
from llm_agent.scenario import DEFAULT_SCENARIO_PATH, load_scenario, sample_behaviors
from llm_agent.stand_ins.inprocess_user_sim import InProcessUserSim
from llm_agent.stand_ins.scripted_policy import ScriptedPolicyWorkerGroup
from verl.utils.dataset import load_tokenizer

from tests.helpers.gen_loop_helpers import record_columns, column, make_gen_batch
from tests.helpers.profiles import profile3

DIALOGUES = 24


def doubt_category(scenario, user_reply: str | None) -> str | None:
    """The category whose scripted doubt line the user said (None: no doubt line)."""
    for category, script in scenario.scripted.categories.items():
        if user_reply and any(line in user_reply for line in script.doubt):
            return category
    return None


@pytest.fixture(scope="module")
def evasive_run(tiny_model_path, tmp_path_factory):
    scenario = load_scenario(DEFAULT_SCENARIO_PATH)
    tokenizer = load_tokenizer(tiny_model_path)
    rng = random.Random(3)
    profiles = [profile3(rng.randint(1, 3), rng.randint(1, 2), rng.randint(1, 4),
                            tuple(sample_behaviors(scenario.behaviors, rng, 1, 3))) for _ in range(DIALOGUES)]
    config = {"scenario": str(DEFAULT_SCENARIO_PATH), "max_turns": 10, "max_tokens_per_turn": 128,
              "max_response_length": 3000, "cache": {"enabled": False}, "controller": {"enabled": False},
              "rollout_log_path": str(tmp_path_factory.mktemp("evasive") / "rollouts.jsonl")}
    policy = ScriptedPolicyWorkerGroup(tokenizer, scenario, world_size=1, quality="evasive")
    loop = LLMGenerationManager(tokenizer, policy, config, is_validation=True, client=InProcessUserSim(scenario))
    batch = make_gen_batch(tokenizer, scenario, [f"k{i}" for i in range(DIALOGUES)], profiles=profiles,
                           meta={"do_sample": False})
    out = loop.run_llm_loop(batch)
    metrics = loop.on_validation_end([out], step=0)  # appends the rollout log
    return scenario, policy.agent.answered, out, metrics, config["rollout_log_path"]


def test_every_lost_call_is_labelled_on_the_skipped_doubt_it_was_lost_on(evasive_run):
    scenario, answered, out, _, _ = evasive_run
    skipped = set(scenario.scripted.categories) - answered
    assert answered and skipped and len(answered) == len(scenario.scripted.categories) // 3
    nt = record_columns(out)
    outcomes = list(nt["outcome"])
    assert "completed" in outcomes and outcomes.count("hung_up") >= DIALOGUES // 3, outcomes
    for i, outcome in enumerate(outcomes):
        turns = nt["turns"][i]
        notes = {e["note"] for t in turns for e in t["diagnosis"] if e["label"] == "doubt_unanswered"}
        if outcome == "completed":
            assert nt["labels"][i] == {} and all(t["diagnosis"] == [] for t in turns), i
            continue
        assert outcome == "hung_up", (i, outcome)
        raised = [doubt_category(scenario, t["user_reply"]) for t in turns[:-1]]
        lost_on = [c for c in raised if c is not None][-1]
        assert lost_on in skipped, (i, lost_on)
        assert lost_on in notes and notes <= skipped, (i, notes, skipped)
        # the labelled turns are exactly those answering a voiced doubt of a skipped category
        labelled = [k for k, t in enumerate(turns) if any(e["label"] == "doubt_unanswered" for e in t["diagnosis"])]
        expected = [k for k in range(1, len(turns)) if raised[k - 1] in skipped
                    and not scenario.scripted.categories[raised[k - 1]].resolve.matches(turns[k]["agent_reply"])]
        assert labelled == expected, (i, labelled, expected)


def test_the_reward_hands_the_records_labels_to_the_trainer(evasive_run):
    scenario, _, out, _, _ = evasive_run
    compute_reward(out, None, scenario=str(DEFAULT_SCENARIO_PATH))
    turn_labels = out.non_tensor_batch["turn_labels"]
    for i, turns in enumerate(column(out, "turns")):
        assert turn_labels[i] == [[e["label"] for e in t["diagnosis"]] for t in turns]
    assert "turn_scores" not in out.batch.keys()  # every turn weight is 0 by default


def test_the_rollout_log_and_the_step_metrics_carry_the_labels(evasive_run):
    scenario, _, _, metrics, log_path = evasive_run
    with open(log_path, encoding="utf-8") as log:
        lines = [json.loads(line) for line in log]
    assert len(lines) == DIALOGUES
    per_label: dict[str, int] = {}
    failed = labelled = 0
    for line in lines:
        counted = {}
        for turn in line["turns"]:
            for entry in turn["diagnosis"]:
                counted[entry["label"]] = counted.get(entry["label"], 0) + 1
        assert line["labels"] == counted, line["dialogue_id"]
        for label, n in counted.items():
            per_label[label] = per_label.get(label, 0) + n
        if line["outcome"] != "completed":
            failed += 1
            labelled += bool(counted)
    assert per_label.get("doubt_unanswered", 0) > 0 and failed > 0
    for rule in scenario.diagnosis:
        assert metrics[f"diagnosis/labels/{rule.label}"] == per_label.get(rule.label, 0), rule.label
    assert metrics["diagnosis/labelled_failure_frac"] == labelled / failed
