"""The iteration driver (utils/iterate.py) with a stand-in trainer: phases, resume, no iteration trained twice.

The stand-in (tests/helpers/iterate_fake_trainer.py) checkpoints through verl.utils.checkpoint like the real trainer; the
slow end-to-end run with the real trainer and a SIGKILL is tests/scripts/test_main_iterations.py.
"""
from __future__ import annotations

import json
import os
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from llm_agent.profiles.sources import load_weights
from llm_agent.scenario import DEFAULT_SCENARIO_PATH
from llm_agent.stand_ins.profile_llm import ScriptedProfileLLM
from utils.iterate import main, with_overrides

REPO = Path(__file__).resolve().parents[2]
FAKE = REPO / "tests" / "helpers" / "iterate_fake_trainer.py"
SCENARIO = str(DEFAULT_SCENARIO_PATH)


@dataclass
class Result:
    """What a driver run ended with: 0 or the SystemExit message."""

    returncode: int
    stderr: str


def driver(tmp_path, *extra, env=None, trainer_args=()):
    argv = ["--iterations", "3", "--steps-per-iteration", "2", "--root", str(tmp_path / "iters"),
            "--ckpt-dir", str(tmp_path / "ckpt"), "--scenario", SCENARIO, "--train-samples", "6",
            "--profiles", "60", *extra, "--",
            sys.executable, str(FAKE), f"trainer.default_local_dir={tmp_path / 'ckpt'}", "trainer.save_freq=1",
            "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.5", "trainer.total_training_steps=99",
            "rollout_loop.config.controller.target_completion_rate=0.5", *trainer_args]
    saved = dict(os.environ)
    os.environ.update({"FAKE_TRAINER_CALLS": str(tmp_path / "calls.jsonl"), **(env or {})})
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        return Result(main(argv), "")
    except SystemExit as exc:
        return Result(1, str(exc.code))
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(saved)


def calls(tmp_path):
    return [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]


@pytest.mark.processes
def test_a_killed_iteration_resumes_and_no_iteration_is_trained_twice(tmp_path):
    died = driver(tmp_path, env={"FAKE_TRAINER_DIE_AT_STEP": "4"})
    assert died.returncode != 0 and "iteration 2: the trainer failed" in died.stderr
    it1 = tmp_path / "iters/iter_01"
    mistakes_1 = (it1 / "mistakes.json").stat().st_mtime_ns
    done = driver(tmp_path)
    assert done.returncode == 0, done.stderr
    spans = [(c["from"], c["to"]) for c in calls(tmp_path)]
    assert spans == [(0, 2), (2, 4), (3, 4), (4, 6)]  # iteration 2 resumed at its checkpoint of step 3
    assert (it1 / "mistakes.json").stat().st_mtime_ns == mistakes_1
    for k, call in enumerate(calls(tmp_path)[:1] + calls(tmp_path)[2:], 1):
        args, it = call["args"], tmp_path / f"iters/iter_{k:02d}"
        assert args["trainer.total_training_steps"] == str(2 * k)
        assert args["rollout_loop.config.controller.profile_source"] == "pool"
        assert args["rollout_loop.config.controller.pool_path"] == str(it / "profiles.jsonl")
        assert args["rollout_loop.config.rollout_log_path"] == str(it / "rollouts.jsonl")
        assert args["data.train_files"] == str(it / "prompt_data/train.parquet")
        assert args["actor_rollout_ref.actor.optim.lr_warmup_steps"] == "3"  # 0.5 x 6 steps, not per iteration
        assert pq.read_table(it / "prompt_data/train.parquet").num_rows == 6
        steps = Counter(json.loads(line)["step"] for line in (it / "rollouts.jsonl").read_text().splitlines())
        assert steps == {2 * k - 1: 4, 2 * k: 4}  # kept apart; step 4's lines of the killed run were cut
    summary = json.loads((tmp_path / "iters/iterations.json").read_text())
    assert [i["steps"] for i in summary["iterations"]] == [[1, 2], [3, 4], [5, 6]]
    assert summary["iterations"][-1]["checkpoint"].endswith("global_step_6")
    again = driver(tmp_path)  # everything done: nothing runs again
    assert again.returncode == 0 and len(calls(tmp_path)) == 4


@pytest.mark.processes
def test_the_next_profiles_follow_the_mistakes_analysis(tmp_path):
    assert driver(tmp_path).returncode == 0
    # The stand-in completes iff cooperation >= 2, so the analysis moves weight between cooperation values and
    # iteration 2's profiles are drawn with those weights, not uniformly as iteration 1's.
    weights = load_weights(tmp_path / "iters/iter_01/mistakes.json", "train")["cooperation"]
    assert max(weights.values()) > 0.34
    meta = json.loads((tmp_path / "iters/iter_02/profiles.jsonl.meta.json").read_text())
    assert meta["weights"]["cooperation"] == pytest.approx(weights)
    first = json.loads((tmp_path / "iters/iter_01/profiles.jsonl.meta.json").read_text())
    assert first["weights"]["cooperation"] == pytest.approx({"1": 1 / 3, "2": 1 / 3, "3": 1 / 3})


@pytest.mark.processes
def test_analysis_lost_after_training_is_redone_without_training(tmp_path):
    assert driver(tmp_path).returncode == 0
    for name in ("mistakes.json", "done.json"):
        (tmp_path / "iters/iter_03" / name).unlink()
    assert driver(tmp_path).returncode == 0
    assert len(calls(tmp_path)) == 3 and (tmp_path / "iters/iter_03/mistakes.json").is_file()


@pytest.mark.processes
def test_a_deleted_checkpoint_is_reported_not_retrained(tmp_path):
    assert driver(tmp_path, "--iterations", "2").returncode == 0
    for path in sorted((tmp_path / "ckpt").iterdir()):
        if path.is_dir():
            for f in path.iterdir():
                f.unlink()
            path.rmdir()
    done = driver(tmp_path)
    assert done.returncode != 0 and "iteration 3 starts at step 4 but the last checkpoint" in done.stderr


@pytest.mark.parametrize("trainer_args, message", [
    (["trainer.save_freq=0"], "trainer.save_freq=0: iterations continue from the last checkpoint"),
    (["rollout_loop.config.controller.enabled=false"], "controller.enabled=false: iterations draw"),
])
def test_settings_that_cannot_iterate_are_refused(tmp_path, trainer_args, message):
    done = driver(tmp_path, trainer_args=trainer_args)
    assert done.returncode != 0 and message in done.stderr and not (tmp_path / "calls.jsonl").exists()


@pytest.mark.processes
def test_simulators_are_restarted_only_when_asked(tmp_path):
    marker = tmp_path / "restarts.txt"
    assert driver(tmp_path).returncode == 0
    assert all("rollout_loop.config.user_sim.urls" not in c["args"] for c in calls(tmp_path))
    restart = f"echo once >> {marker}; echo stopping; echo http://127.0.0.1:9,http://127.0.0.1:10"
    other = tmp_path / "asked"
    other.mkdir()
    assert driver(other, "--sim-restart-command", restart).returncode == 0
    assert marker.read_text().split() == ["once", "once"]  # before iterations 2 and 3, not 1
    urls = [c["args"].get("rollout_loop.config.user_sim.urls") for c in calls(other)]
    assert urls == [None, "'http://127.0.0.1:9,http://127.0.0.1:10'", "'http://127.0.0.1:9,http://127.0.0.1:10'"]


@pytest.mark.processes
def test_profiles_are_written_by_the_llm_endpoint_when_given(tmp_path):
    with ScriptedProfileLLM("mixed", bad_share=0.3) as llm:
        assert driver(tmp_path, "--iterations", "2", "--llm-url", llm.url).returncode == 0
        assert llm.requests >= 120  # 60 profiles per iteration, bad answers asked again
    for k in (1, 2):
        stats = json.loads((tmp_path / f"iters/iter_0{k}/profiles.done").read_text())
        assert stats["by_source"].get("llm", 0) >= 50 and stats["rows_violating_rules"] == {}
        assert stats["this_run"]["rejected/score_changed"] > 0


def test_overrides_replace_earlier_values_of_the_same_key():
    cmd = ["python", "-m", "x", "a.b=1", "+c.d=2", "e=3"]
    assert with_overrides(cmd, {"a.b": "9", "c.d": "8"}) == ["python", "-m", "x", "e=3", "a.b=9", "c.d=8"]
