"""Evaluation settings from the evaluated checkpoint's training config, and its global_step in the results."""
from __future__ import annotations

import json

import pytest

from llm_agent.evaluation.checkpoint_settings import checkpoint_info, settings_from_checkpoints
from llm_agent.evaluation.runner import evaluate_agent
from llm_agent.stand_ins.inprocess_user_sim import InProcessUserSim
from llm_agent.stand_ins.scripted_policy import ScriptedPolicyWorkerGroup
from utils.create_prompt_data import create_prompt_data

from tests.helpers.checkpoint_fixtures import demo_config, fake_checkpoint
from tests.helpers.for_evaluation_cli import load_script
from tests.helpers.repo import SCENARIO_PATH


def test_a_checkpoint_root_is_its_latest_step_with_its_config(tmp_path):
    fake_checkpoint(tmp_path / "ckpt", 2, demo_config(max_turns=6))
    fake_checkpoint(tmp_path / "ckpt", 4, demo_config())
    for spec in ("ckpt", "ckpt/global_step_4", "ckpt/global_step_4/actor"):
        info = checkpoint_info(str(tmp_path / spec))
        assert (info.step_dir, info.global_step) == (tmp_path / "ckpt" / "global_step_4", 4)
        assert info.setting("max_turns") == 10
        assert info.setting("test_file") == "/the/run/outputs/prompt_data/demo/test.parquet"  # the run's directory
    assert checkpoint_info(str(tmp_path / "ckpt/global_step_2")).setting("max_turns") == 6
    plain = tmp_path / "model"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    assert checkpoint_info(str(plain)) is None  # a model directory, not a checkpoint


def test_the_command_line_wins_and_disagreeing_checkpoints_are_refused(tmp_path):
    a = checkpoint_info(str(fake_checkpoint(tmp_path / "a", 1, demo_config(max_turns=10))))
    b = checkpoint_info(str(fake_checkpoint(tmp_path / "b", 1, demo_config(max_turns=15))))
    old = checkpoint_info(str(fake_checkpoint(tmp_path / "old", 1)))  # no trainer_config.json
    values, origin = settings_from_checkpoints({"max_turns": 8}, [("a", a), ("old", old)])
    assert values["max_turns"] == 8 and origin["max_turns"] == "command line"
    assert (values["max_user_tokens"], values["sim_temperature"], values["seed"]) == (48, 0.5, 3)
    assert origin["max_user_tokens"] == "rollout_loop.config.max_user_tokens of a's training config"
    with pytest.raises(ValueError, match=r"different rollout_loop.config.max_turns \(a: 10, b: 15\); pass "
                                         "--max-turns"):
        settings_from_checkpoints({}, [("a", a), ("b", b)])
    assert settings_from_checkpoints({"max_turns": 12}, [("a", a), ("b", b)])[0]["max_turns"] == 12
    values, origin = settings_from_checkpoints({}, [("old", old)])
    assert values.get("max_turns") is None and "max_turns" not in origin


def test_evaluate_resolves_settings_command_line_then_checkpoint_then_defaults(tmp_path):
    evaluate = load_script("evaluate")
    info = checkpoint_info(str(fake_checkpoint(tmp_path / "ckpt", 3, demo_config())))
    args = evaluate.parse_args(["--agent", str(tmp_path / "ckpt"), "--max-user-tokens", "20"])
    values, origin = evaluate.resolve_settings(args, [("ckpt", info)])
    assert (values["max_turns"], values["max_tokens_per_turn"], values["max_response_length"]) == (10, 64, 768)
    assert (values["max_prompt_length"], values["max_user_tokens"]) == (96, 20)
    assert origin["max_user_tokens"] == "command line" and origin["max_turns"].endswith("of ckpt's training config")
    values, origin = evaluate.resolve_settings(evaluate.parse_args(["--agent", "x", "--test-file", "t.parquet"]), [])
    assert values["max_turns"] == 10 and values["max_prompt_length"] == 4096 and origin["max_turns"] == "default"
    with pytest.raises(ValueError, match="no test file: pass --test-file"):
        evaluate.resolve_settings(evaluate.parse_args(["--agent", "x"]), [])


def test_results_record_the_global_step_and_a_newer_step_is_not_resumed(tok, scenario, tmp_path):
    from llm_agent.evaluation.runner import EvalSettings

    test_file = str(create_prompt_data(SCENARIO_PATH, tmp_path / "data", train_samples=1, test_samples=2,
                                       seed=1)["test"])
    settings = EvalSettings(scenario=str(SCENARIO_PATH), test_file=test_file, max_dialogues=2, max_turns=4,
                            max_tokens_per_turn=256, max_response_length=2048)

    def run(step):
        return evaluate_agent("rl", ScriptedPolicyWorkerGroup(tok, scenario, world_size=1), tok, settings,
                              tmp_path / "out", client=InProcessUserSim(scenario), n_resamples=20, step=step,
                              checkpoint=f"/ckpt/global_step_{step}", settings_origin={"max_turns": "command line"})

    results = run(4).results
    assert (results["global_step"], results["step"], results["checkpoint"]) == (4, 4, "/ckpt/global_step_4")
    assert results["settings_origin"] == {"max_turns": "command line"}
    assert {json.loads(line)["step"] for line in (tmp_path / "out" / "rl_dialogues.jsonl").read_text().splitlines()} == {4}
    assert run(4).n_resumed == 2
    with pytest.raises(ValueError, match=r"run with the agent at step 4, but it is now at step 6 .*--agent NEWNAME=SPEC"):
        run(6)
    # every line is checked, not only each dialogue's latest: lines at step 6 after the step-4 ones hide nothing
    log = tmp_path / "out" / "rl_dialogues.jsonl"
    lines = log.read_text().splitlines()
    later = [json.dumps({**json.loads(line), "step": 6}) for line in lines]
    log.write_text("\n".join(lines + later) + "\n")
    with pytest.raises(ValueError, match=r"rl_dialogues.jsonl:1: dialogue test0#0 was run with the agent at step 4"):
        run(6)
