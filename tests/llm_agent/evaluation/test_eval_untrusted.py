"""The evaluation against hostile simulators, with secrets, and resumed from files it did not write as they are
(issue 29, items 1, 3 and 8): a simulator answering deeply nested JSON beside a healthy one, API keys that never
reach a file the evaluation writes, an error or argv, and resumes that never count dialogues under settings they
were not run with."""
from __future__ import annotations

import json
import os

import pytest

from llm_agent.evaluation.dialogue_log import read_dialogue_log
from llm_agent.evaluation.runner import EvalSettings, dialogues_path, evaluate_agent, settings_path
from llm_agent.stand_ins.inprocess_user_sim import InProcessUserSim
from llm_agent.stand_ins.scripted_policy import ScriptedPolicyWorkerGroup
from utils.create_prompt_data import create_prompt_data

from tests.helpers.for_evaluation_cli import load_script
from tests.helpers.hostile_openai import HostileOpenAIServer
from tests.helpers.repo import SCENARIO_PATH

SIM_KEY, AGENT_KEY = "sk-sim-0123456789abcdef", "sk-agent-fedcba9876543210"
STATE = {"cooperation": 2, "emotion": 2, "trust": 2}


@pytest.fixture(scope="module")
def test_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("prompt_data")
    return str(create_prompt_data(SCENARIO_PATH, out, train_samples=1, test_samples=4, seed=3)["test"])


def _settings(test_file, **overrides):
    values = dict(scenario=str(SCENARIO_PATH), test_file=test_file, max_dialogues=4, max_turns=8,
                  max_tokens_per_turn=256, max_response_length=3072)
    values.update(overrides)
    return EvalSettings(**values)


def _run(tok, scenario, test_file, out, **overrides):
    agent = ScriptedPolicyWorkerGroup(tok, scenario, world_size=1, quality="good")
    return evaluate_agent("agent", agent, tok, _settings(test_file, **overrides), out,
                          client=InProcessUserSim(scenario), chunk_size=2, n_resamples=50)


def _key_file(path, key):
    path.write_text(key + "\n")
    path.chmod(0o600)
    return str(path)


def test_a_nested_simulator_beside_a_healthy_one_and_keys_that_reach_no_file(tiny_model_path, scenario, test_file,
                                                                             tmp_path, monkeypatch, capsys, caplog):
    evaluate = load_script("evaluate")
    out = tmp_path / "out"
    agent_turn = scenario.format_agent_output("Hello, may I tell you about a free trial?", 0, 0, STATE)
    user_turn = scenario.format_user_output("Go on.", STATE, 0)
    monkeypatch.setenv("SEAD_AGENT_API_KEY", AGENT_KEY)
    monkeypatch.delenv("SEAD_USER_SIM_API_KEY", raising=False)
    with HostileOpenAIServer("nested_post") as bad, HostileOpenAIServer("ok", user_turn, api_key=SIM_KEY) as good, \
            HostileOpenAIServer("ok", agent_turn, api_key=AGENT_KEY) as agent:
        argv = ["--agent", f"hosted={agent.url}", "--tokenizer", tiny_model_path, "--agent-model", "m",
                "--test-file", test_file, "--out", str(out), "--user-sim-urls", f"{bad.url},{good.url}",
                "--sim-model", "m", "--sim-api-key-file", _key_file(tmp_path / "sim.key", SIM_KEY),
                "--max-turns", "2", "--chunk-size", "2", "--n-resamples", "50"]
        evaluate.main(argv)  # no SystemExit
        assert bad.requests > 0 and good.requests > 0 and agent.requests > 0
        with pytest.raises(SystemExit) as refused:  # other settings: the error names them, never a key
            evaluate.main([*argv, "--max-turns", "3"])
    results = json.loads((out / "hosted_results.json").read_text())
    assert results["n_dialogues"] == 4 and "error" not in results["outcomes"], results["outcomes"]
    written = [p for p in out.rglob("*") if p.is_file()]
    assert {p.name for p in written} >= {"hosted_results.json", "hosted_dialogues.jsonl", "hosted_settings.json"}
    for path in written:
        data = path.read_bytes()
        assert SIM_KEY.encode() not in data and AGENT_KEY.encode() not in data, path
    shown = str(refused.value) + capsys.readouterr().err + caplog.text
    assert "max_turns" in str(refused.value) and SIM_KEY not in shown and AGENT_KEY not in shown


@pytest.mark.parametrize("flag", ["--sim-api-key", "--agent-api-key"])
def test_keys_on_the_command_line_are_refused_without_echoing_them(flag, capsys):
    evaluate = load_script("evaluate")
    with pytest.raises(SystemExit) as refused:
        evaluate.main(["--agent", "scripted:good", flag, SIM_KEY])
    message = str(refused.value) + capsys.readouterr().err
    assert "/proc" in message and f"{flag}-file" in message and SIM_KEY not in message


def test_a_key_file_others_may_read_is_refused(tmp_path):
    evaluate = load_script("evaluate")
    key = tmp_path / "sim.key"
    key.write_text(SIM_KEY)
    key.chmod(0o644)
    with pytest.raises(SystemExit, match="chmod 600") as refused:
        evaluate.main(["--agent", "scripted:good", "--sim-api-key-file", str(key)])
    assert SIM_KEY not in str(refused.value)


def test_a_resume_without_the_settings_file_is_checked_line_by_line(tok, scenario, test_file, tmp_path):
    _run(tok, scenario, test_file, tmp_path, max_turns=7)
    settings_path(tmp_path, "agent").unlink()
    with pytest.raises(ValueError, match=r"agent_dialogues.jsonl:1: .*other settings .*max_turns"):
        _run(tok, scenario, test_file, tmp_path, max_turns=2)
    summary = _run(tok, scenario, test_file, tmp_path, max_turns=7)  # the same settings resume
    assert (summary.n_run, summary.n_resumed) == (0, 4) and settings_path(tmp_path, "agent").is_file()


def test_lines_written_under_other_settings_are_never_counted(tok, scenario, test_file, tmp_path):
    _run(tok, scenario, test_file, tmp_path / "a", max_turns=7, max_dialogues=2)
    _run(tok, scenario, test_file, tmp_path / "b", max_turns=2, max_dialogues=2)
    foreign = dialogues_path(tmp_path / "a", "agent").read_text()
    with open(dialogues_path(tmp_path / "b", "agent"), "a") as f:
        f.write(foreign)
    with pytest.raises(ValueError, match=r"agent_dialogues.jsonl:3: .*other settings .*max_turns"):
        _run(tok, scenario, test_file, tmp_path / "b", max_turns=2, max_dialogues=4)


def test_a_torn_tail_is_cut_and_its_bytes_kept(tok, scenario, test_file, tmp_path):
    _run(tok, scenario, test_file, tmp_path, max_dialogues=2)
    log = dialogues_path(tmp_path, "agent")
    torn = b'{"step": 0, "split": "eval", "dialogue_id": "test2#0", "outcome": "compl'
    with open(log, "ab") as f:
        f.write(torn)
    summary = _run(tok, scenario, test_file, tmp_path, max_dialogues=3)
    assert (summary.n_run, summary.n_resumed) == (1, 2)
    assert (tmp_path / "agent_dialogues.jsonl.torn").read_bytes() == torn
    assert [json.loads(line)["dialogue_id"] for line in log.read_text().splitlines()] == ["test0#0", "test1#0",
                                                                                           "test2#0"]


def test_a_deeply_nested_line_is_an_error_naming_the_file_and_a_torn_one_is_cut(tmp_path):
    path = tmp_path / "x_dialogues.jsonl"
    nested = b'{"a": ' * 100_000 + b"1" + b"}" * 100_000
    path.write_bytes(b'{"dialogue_id": "a#0"}\n' + nested + b"\n")
    with pytest.raises(ValueError, match=r"x_dialogues.jsonl:2: .*nested"):
        read_dialogue_log(path)
    path.write_bytes(b'{"dialogue_id": "a#0"}\n' + nested[:-10])
    log = read_dialogue_log(path)
    assert [r["dialogue_id"] for r in log.records] == ["a#0"] and log.torn_tail
    assert os.path.getsize(path) == len(b'{"dialogue_id": "a#0"}\n') + len(nested) - 10
