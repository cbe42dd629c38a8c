"""evaluate_agent with the scripted agent and the in-process simulator: the same dialogues as the validation
loop run directly, resumption of missing dialogues only, torn lines, and refusals of a mismatched resume."""
from __future__ import annotations

import json

import pytest

from llm_agent.evaluation.dialogue_log import read_dialogue_log
from llm_agent.evaluation.runner import EvalSettings, dialogues_path, evaluate_agent, results_path
from llm_agent.generation import LLMGenerationManager
from llm_agent.metrics import records_from_batch
from llm_agent.rollout.records import object_column
from llm_agent.stand_ins.inprocess_user_sim import InProcessUserSim
from llm_agent.stand_ins.scripted_policy import ScriptedPolicyWorkerGroup
from utils.create_prompt_data import create_prompt_data
from verl.utils.dataset import RLHFDataset

from tests.helpers.repo import SCENARIO_PATH


class RecordingSim(InProcessUserSim):
    """The in-process simulator, remembering which dialogues it answered."""

    def __init__(self, scenario):
        super().__init__(scenario)
        self.dialogue_ids = set()

    def complete(self, requests):
        self.dialogue_ids.update(r.dialogue_id for r in requests)
        return super().complete(requests)


@pytest.fixture(scope="module")
def test_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("prompt_data")
    return str(create_prompt_data(SCENARIO_PATH, out, train_samples=1, test_samples=8, seed=3)["test"])


def settings(test_file, **overrides):
    values = dict(scenario=str(SCENARIO_PATH), test_file=test_file, max_dialogues=8, max_turns=8,
                  max_tokens_per_turn=256, max_response_length=3072)
    values.update(overrides)
    return EvalSettings(**values)


def run(tok, scenario, test_file, out, quality="good", sim=None, **overrides):
    agent = ScriptedPolicyWorkerGroup(tok, scenario, world_size=1, quality=quality)
    return evaluate_agent("agent", agent, tok, settings(test_file, **overrides), out, client=sim or InProcessUserSim(scenario),
                          chunk_size=3, n_resamples=100)


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_dialogues_equal_the_validation_loop_run_directly(tok, scenario, test_file, tmp_path):
    summary = run(tok, scenario, test_file, tmp_path)
    logged = lines(dialogues_path(tmp_path, "agent"))
    assert summary.n_run == 8 and [r["dialogue_id"] for r in logged] == [f"test{i}#0" for i in range(8)]
    assert {r["split"] for r in logged} == {"eval"} and all("reward_components" in r for r in logged)

    dataset = RLHFDataset(test_file, tok, max_prompt_length=4096)
    batch = dataset.collate(list(range(8)))
    batch.non_tensor_batch["uid"] = object_column([f"test{i}" for i in range(8)])
    batch.meta_info = {"do_sample": False}
    loop = LLMGenerationManager(tok, ScriptedPolicyWorkerGroup(tok, scenario, world_size=2),
                                settings(test_file).loop_config(None), is_validation=True,
                                client=InProcessUserSim(scenario))
    direct = [r.to_dict() for r in records_from_batch(loop.run_llm_loop(batch))]
    for got, want in zip(logged, direct):
        assert (got["dialogue_id"], got["outcome"], got["num_turns"]) == (want["dialogue_id"], want["outcome"],
                                                                          want["num_turns"])
        assert [t["agent_text"] for t in got["turns"]] == [t["agent_text"] for t in want["turns"]]
        assert got["profile"] == json.loads(dataset.rows[int(got["uid"][4:])]["user_profile"])

    results = json.loads(results_path(tmp_path, "agent").read_text())
    outcomes = [r["outcome"] for r in logged]
    assert results["n_dialogues"] == 8 and results["outcomes"] == {o: outcomes.count(o) for o in set(outcomes)}
    cr = results["metrics"]["completion_rate"]
    assert cr["value"] == pytest.approx(outcomes.count("completed") / 8) and cr["low"] <= cr["value"] <= cr["high"]


def test_a_rerun_runs_only_missing_dialogues_and_cuts_a_torn_line(tok, scenario, test_file, tmp_path):
    first = run(tok, scenario, test_file, tmp_path, max_dialogues=3)
    assert (first.n_run, first.n_resumed) == (3, 0)
    log = dialogues_path(tmp_path, "agent")
    before = log.read_text()
    with open(log, "a") as f:  # an append interrupted by a kill
        f.write('{"step": 0, "split": "eval", "dialogue_id": "test3#0", "outc')
    sim = RecordingSim(scenario)
    again = run(tok, scenario, test_file, tmp_path, sim=sim, max_dialogues=5)  # extend the selection
    assert (again.n_run, again.n_resumed) == (2, 3) and sim.dialogue_ids == {"test3#0", "test4#0"}
    text = log.read_text()
    assert text.startswith(before) and [r["dialogue_id"] for r in lines(log)] == [f"test{i}#0" for i in range(5)]
    assert json.loads(results_path(tmp_path, "agent").read_text())["n_dialogues"] == 5


def test_an_interrupted_run_resumes_with_the_missing_dialogues_only(tok, scenario, test_file, tmp_path):
    class Interrupt(Exception):
        pass

    class FailingSim(InProcessUserSim):
        """Dies on the first request of the third chunk (dialogues test6..test7)."""

        def complete(self, requests):
            if any(r.dialogue_id == "test6#0" for r in requests):
                raise Interrupt
            return super().complete(requests)

    with pytest.raises(Interrupt):
        run(tok, scenario, test_file, tmp_path, sim=FailingSim(scenario))
    log = dialogues_path(tmp_path, "agent")
    first_lines = log.read_text()
    assert [r["dialogue_id"] for r in lines(log)] == [f"test{i}#0" for i in range(6)]
    with open(log, "a") as f:
        f.write('{"step": 0, "spl')
    sim = RecordingSim(scenario)
    summary = run(tok, scenario, test_file, tmp_path, sim=sim)
    assert (summary.n_run, summary.n_resumed) == (2, 6) and sim.dialogue_ids == {"test6#0", "test7#0"}
    text = log.read_text()
    assert text.startswith(first_lines) and [r["dialogue_id"] for r in lines(log)] == [f"test{i}#0" for i in range(8)]


def test_a_resume_with_other_settings_or_profiles_is_refused(tok, scenario, test_file, tmp_path):
    run(tok, scenario, test_file, tmp_path, max_dialogues=2)
    with pytest.raises(ValueError, match=r"other settings \(max_turns") as refused:
        run(tok, scenario, test_file, tmp_path, max_dialogues=2, max_turns=5)
    # the advice names flags that exist (evaluate.py has no --name)
    assert "--agent NEWNAME=SPEC" in str(refused.value) and "--name" not in str(refused.value)
    log = dialogues_path(tmp_path, "agent")
    records = lines(log)
    records[1]["profile"]["trust"] = (records[1]["profile"]["trust"] + 1) % 3
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(ValueError, match="test1#0 has profile .* another test set"):
        run(tok, scenario, test_file, tmp_path, max_dialogues=2)


def test_a_broken_line_inside_a_log_is_an_error_naming_it(tmp_path):
    path = tmp_path / "x_dialogues.jsonl"
    path.write_text('{"dialogue_id": "a#0"}\nnot json\n{"dialogue_id": "b#0"}\n')
    with pytest.raises(ValueError, match=r"x_dialogues.jsonl:2: not a JSON object line"):
        read_dialogue_log(path)
    path.write_text('{"dialogue_id": "a#0"}\n{"dialogue_id": "b')
    log = read_dialogue_log(path)
    assert [r["dialogue_id"] for r in log.records] == ["a#0"] and log.torn_tail and log.valid_bytes == 23


def test_each_dialogue_records_what_it_cost(tok, scenario, test_file, tmp_path):
    run(tok, scenario, test_file, tmp_path)
    logged = lines(dialogues_path(tmp_path, "agent"))
    for r in logged:
        # every user turn came from the simulator (validation: no cache) with one request each
        assert r["sim_requests"] == sum(t["user_source"] == "simulator" for t in r["turns"]) + r["sim_retries"]
        # the agent's sampled tokens: its turns' text re-encoded, plus the end-of-turn token it sampled each time
        encoded = sum(len(tok.encode(t["agent_text"], add_special_tokens=False)) + 1 for t in r["turns"])
        assert r["agent_tokens"] == encoded, r["dialogue_id"]
    # chunks of 3: the dialogues of one rollout call share its wall time equally
    shares = [r["wall_s"] for r in logged]
    assert all(s > 0 for s in shares) and shares[0] == shares[1] == shares[2] and shares[3] == shares[4] == shares[5]
    metrics = json.loads(results_path(tmp_path, "agent").read_text())["metrics"]
    assert metrics["sim_requests_per_dialogue"]["value"] == pytest.approx(sum(r["sim_requests"] for r in logged) / 8)
    assert metrics["seconds_per_dialogue"]["value"] == pytest.approx(sum(shares) / 8)
