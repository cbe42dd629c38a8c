"""Cross-judge evaluation (`evaluate.py --judge NAME=URLS`): one agent graded by two real scripted simulator
servers that differ by construction (`tests/helpers/judges.py`: the `deaf` one never lets a cost-concerns doubt be
settled). The per-judge CRs, their difference and the dialogues only one judge let complete are recounted from the
written dialogues; the judges ran the same profiles with the same seeds; bad `--judge` values are refused."""
from __future__ import annotations

import json

import pytest

from llm_agent.evaluation.judges import parse_judges
from utils.create_prompt_data import create_prompt_data

from tests.helpers.for_evaluation_cli import load_script
from tests.helpers.judges import base_and_deaf_servers, completion_rate, has_category
from tests.helpers.repo import SCENARIO_PATH

N_DIALOGUES = 8


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.processes
def test_cross_judge_cr_difference_is_the_one_recounted_from_the_dialogues(tiny_model_path, tmp_path):
    test_file = str(create_prompt_data(SCENARIO_PATH, tmp_path / "data", train_samples=1, test_samples=N_DIALOGUES,
                                       seed=5)["test"])
    evaluate = load_script("evaluate")
    out = tmp_path / "eval"
    with base_and_deaf_servers(tmp_path) as urls:
        argv = ["--agent", "good=scripted:good", "--tokenizer", tiny_model_path, "--test-file", test_file,
                "--out", str(out), "--judge", f"base={urls['base']}", "--judge", f"deaf={urls['deaf']}",
                "--max-turns", "8", "--max-tokens-per-turn", "256", "--max-response-length", "3072",
                "--chunk-size", "4", "--n-resamples", "200"]
        written = evaluate.run(evaluate.parse_args(argv))
    assert written == [out / "base" / "good_results.json", out / "deaf" / "good_results.json"]
    base, deaf = lines(out / "base" / "good_dialogues.jsonl"), lines(out / "deaf" / "good_dialogues.jsonl")
    assert [(b["dialogue_id"], b["profile"]) for b in base] == [(d["dialogue_id"], d["profile"]) for d in deaf]
    affected = [has_category(b) for b in base]
    assert any(affected) and not all(affected), "the test set must hold users with and without the behaviour"
    for b, d, hit in zip(base, deaf, affected):
        assert b["outcome"] == "completed"  # the good agent settles every doubt of the unchanged persona
        if hit:  # the deaf judge cannot let it complete
            assert d["outcome"] != "completed"
        else:  # same profile, same seeds, same rules: the same dialogue word for word
            said = [[(t["agent_text"], t["user_reply"]) for t in line["turns"]] for line in (b, d)]
            assert said[0] == said[1]
            assert d["outcome"] == "completed"

    summary = json.loads((out / "cross_judge.json").read_text())
    cr_base, cr_deaf = completion_rate(base), completion_rate(deaf)
    rows = summary["rows"]
    assert rows["good@base"]["metrics"]["completion_rate"]["value"] == pytest.approx(cr_base)
    assert rows["good@deaf"]["metrics"]["completion_rate"]["value"] == pytest.approx(cr_deaf)
    (pair,) = summary["pairs"]
    assert (pair["a"], pair["b"], pair["n_pairs"]) == ("good@base", "good@deaf", N_DIALOGUES)
    difference = pair["cr_difference"]
    assert difference["value"] == pytest.approx(cr_base - cr_deaf) and cr_base - cr_deaf > 0
    assert difference["low"] <= difference["value"] <= difference["high"]
    lost = sum(b["outcome"] == "completed" and d["outcome"] != "completed" for b, d in zip(base, deaf))
    gained = sum(d["outcome"] == "completed" and b["outcome"] != "completed" for b, d in zip(base, deaf))
    assert (pair["only_a_completed"], pair["only_b_completed"]) == (lost, gained) == (sum(affected), 0)
    table = (out / "cross_judge.txt").read_text()
    assert "good@base vs good@deaf" in table and f"{cr_base - cr_deaf:.3f}" in table


@pytest.mark.parametrize("specs, message", [
    (["base"], "expected NAME=URL"),
    (["a b=http://127.0.0.1:5000"], "judge name 'a b'"),
    (["../x=http://127.0.0.1:5000"], "judge name '../x'"),
    (["a=http://127.0.0.1:5000", "a=http://127.0.0.1:5001"], "given twice"),
    (["a=ftp://127.0.0.1:5000"], "--judge.a"),
    (["a=http://user:secret@127.0.0.1:5000"], "--judge.a"),
    (["a="], "no user-simulator url"),
])
def test_bad_judges_are_refused_with_the_judge_named(specs, message):
    with pytest.raises(ValueError) as err:
        parse_judges(specs)
    assert message in str(err.value) and "secret" not in str(err.value)


def test_judge_and_user_sim_urls_exclude_each_other(tmp_path):
    evaluate = load_script("evaluate")
    args = evaluate.parse_args(["--agent", "scripted:good", "--user-sim-urls", "http://127.0.0.1:5000",
                                "--judge", "a=http://127.0.0.1:5001", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="exclude each other"):
        evaluate.run(args)
