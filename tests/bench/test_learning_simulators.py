"""bench/learning.py's training simulator and second judge (`--simulator`, `--judge`): bad choices are refused
before anything starts, and the trainer's config gets the judge and the LLM simulator's client settings."""
from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

import bench.learning
from bench.learning import (LearningSettings, check_simulators, main, simulator_overrides, start_simulator,
                            trainer_overrides)
from llm_agent.rollout.config import GenerationConfig
from verl.trainer.config_schema import compose_config
from verl.trainer.config_validation import load_config


@pytest.mark.parametrize("simulator, judge, message", [
    ("human", "", r"--simulator must be one of \['scripted', 'llm'\], got 'human'"),
    ("scripted", "gpt", r"--judge must be empty or one of \['scripted', 'llm'\], got 'gpt'"),
    ("llm", "llm", r"--judge llm is the training simulator"),
])
def test_bad_simulator_choices_are_refused(simulator, judge, message):
    with pytest.raises(ValueError, match=message):
        check_simulators(LearningSettings(simulator=simulator, judge=judge))


def test_the_command_line_refuses_them_before_anything_starts(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--judge", "scripted", "--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "out.json")])
    assert exit_.value.code == 2 and "--judge scripted is the training simulator" in capsys.readouterr().err
    assert not (tmp_path / "work").exists() and not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("simulator, judge", [("llm", "scripted"), ("scripted", "llm"), ("scripted", "")])
def test_the_trainer_config_carries_the_judge_and_the_llm_client_settings(tiny_model_path, tmp_path, simulator,
                                                                         judge):
    s = LearningSettings(simulator=simulator, judge=judge)
    data = {"train": tmp_path / "train.parquet", "test": tmp_path / "test.parquet"}
    for path in data.values():
        path.touch()  # the config checks that they exist
    urls, judge_urls = ["http://127.0.0.1:5000"], ["http://127.0.0.1:5100", "http://127.0.0.1:5101"]
    overrides = trainer_overrides(s, Path(tiny_model_path), data, tmp_path, ",".join(urls))
    overrides += simulator_overrides(s, urls, judge_urls if judge else [])
    loop = GenerationConfig.from_dict(load_config(compose_config(overrides, config_name="sead_trainer"))
                                      .rollout_loop.config)  # as the rollout loop reads it
    assert list(loop.user_sim.urls) == urls
    assert {name: list(value) for name, value in loop.judges.items()} == ({judge: judge_urls} if judge else {})
    llm_in_run = "llm" in (simulator, judge)  # the tiny LLM simulator's reply budget and patience
    assert (loop.user_sim.max_tokens == 128 and loop.user_sim.timeout_s == 120) == llm_in_run


def test_scripted_simulators_answer_after_the_injected_latency_when_asked(monkeypatch, tmp_path):
    started = []

    class Group:  # records what the benchmark asks of its simulator group
        def __init__(self, directory, spec) -> None:
            self.spec = spec

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            return None

        def start_many(self, n, *flags):
            started.append((n, flags))
            return [f"http://127.0.0.1:{5000 + i}" for i in range(n)]

    monkeypatch.setattr(bench.learning, "SimulatorGroup", Group)
    with contextlib.ExitStack() as stack:
        start_simulator("scripted", LearningSettings(sim_latency_ms=250.0, sim_latency_sigma=1.0), tmp_path, stack)
        start_simulator("scripted", LearningSettings(), tmp_path, stack)
    assert started == [(2, ("--inject-latency-ms", "250.0", "--inject-latency-sigma", "1.0")), (2, ())]
