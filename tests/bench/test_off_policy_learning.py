"""bench/off_policy_learning.py: each mode's overrides pass the config checks, the training time to the target CR and
the pairing of two runs' validations, against hand-computed fixtures."""
from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest

from bench.learning import LearningSettings, trainer_overrides
from bench.learning_stats import paired_runs, sign_test_two_sided
from bench.off_policy import MODES
from bench.off_policy_learning import (VAL_WALL, done_with_these_settings, learning_command, main, mode_overrides,
                                      parser, run_figures)
from verl.trainer.config_schema import compose_config
from verl.trainer.config_validation import load_config


@pytest.mark.parametrize("mode", sorted(MODES))
def test_each_mode_is_a_valid_config_of_the_learning_recipe(mode, tmp_path):
    settings = LearningSettings(overrides=" ".join(mode_overrides(mode)))
    data = {"train": tmp_path / "train.parquet", "test": tmp_path / "test.parquet"}
    config = load_config(compose_config(trainer_overrides(settings, tmp_path, data, tmp_path, "http://127.0.0.1:1"),
                                        config_name="sead_trainer"), check_paths=False)
    staleness, in_flight, rollout_devices = MODES[mode]
    assert config.async_training.staleness_threshold == staleness
    assert config.async_training.rollouts_in_flight == in_flight
    assert config.actor_rollout_ref.rollout.n_gpus_per_node == rollout_devices
    assert config.rollout_loop.config["mode"] == "async"


def test_two_sided_sign_test_by_enumerating_every_outcome():
    for gained, lost in [(0, 0), (3, 0), (0, 3), (5, 2), (2, 5), (4, 4), (9, 1)]:
        n = gained + lost
        observed = abs(gained - lost)
        extreme = sum(abs(2 * sum(bits) - n) >= observed for bits in itertools.product((0, 1), repeat=n))
        assert sign_test_two_sided(gained, lost) == pytest.approx(extreme / 2 ** n)


def _val(step: int, position: int, outcome: str) -> dict:
    return {"step": step, "split": "val", "uid": f"val{step}_0_{position}", "dialogue_id": f"val{step}_0_{position}#0",
            "profile": {"trust": position}, "outcome": outcome}


def test_paired_runs_counts_profiles_gained_and_lost_from_the_base_run():
    base = [_val(8, i, o) for i, o in enumerate(["completed", "hung_up", "hung_up", "completed"])]
    other = [_val(8, i, o) for i, o in reversed(list(enumerate(["completed", "completed", "completed", "hung_up"])))]
    assert paired_runs(base, other, 8) == {"n": 4, "completed_before": 2, "completed_after": 3, "gained": 2, "lost": 1,
                                           "p_one_sided": pytest.approx(0.5), "p_two_sided": pytest.approx(1.0)}
    with pytest.raises(ValueError, match="did not call the same profiles"):
        paired_runs(base, other[:3], 8)


def _write_run(work: Path, curve: dict[int, float], step_s: list[float], idle: bool,
               val_s: dict[int, float] | None = None) -> None:
    (work / "logs").mkdir(parents=True)
    record = {"val_curve": [{"step": s, "completion_rate": cr} for s, cr in curve.items()], "wall_s": {"grpo": 99.0}}
    (work / "learning.json").write_text(json.dumps(record))
    val_s = val_s or {}
    lines = [{"step": 0, "val/completion_rate": curve[0]}]  # the validation before training: no step time
    if 0 in val_s:
        lines[0][VAL_WALL] = val_s[0]
    for step, seconds in enumerate(step_s, start=1):
        line = {"step": step, "timing_s/step": seconds, "timing_s/gen": seconds / 2, "timing_s/reward": 0.0,
                "rollout/time_user_sim_s": seconds / 4}
        if idle:
            line.update({"async/trainer_idle_s": 1.0, "async/rollout_idle_s": 0.5, "async/staleness_mean": 0.5,
                         "async/staleness_max": 2.0, "async/tokens_stale_frac": 0.5,
                         "async/dialogues_mixed_versions_frac": 0.25})
        if step in val_s:
            line[VAL_WALL] = val_s[step]
        lines.append(line)
    (work / "logs" / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_training_time_to_target_sums_step_times_through_the_first_validation_that_reaches_it(tmp_path):
    _write_run(tmp_path / "sync", {0: 0.20, 4: 0.35, 8: 0.45}, [10.0, 20.0, 30.0, 40.0, 1.0, 2.0, 3.0, 4.0], False)
    figures = run_figures("sync", tmp_path / "sync", 0.2)
    assert figures["target_cr"] == pytest.approx(0.40)
    assert figures["step_to_target"] == 8 and figures["train_s_to_target"] == pytest.approx(110.0)
    assert figures["train_s"] == pytest.approx(110.0) and figures["grpo_wall_s"] == 99.0
    assert figures["wall_s"] is None and figures["wall_s_to_target"] is None  # no validation timed
    assert figures["trainer_idle_frac"] == pytest.approx(0.5)  # sync: the trainer waits for the whole rollout
    assert figures["simulator_idle_frac"] == pytest.approx(0.75)

    _write_run(tmp_path / "off", {0: 0.20, 4: 0.40, 8: 0.30}, [10.0, 10.0, 10.0, 10.0, 5.0, 5.0, 5.0, 5.0], True,
               {0: 7.0, 4: 9.0, 8: 11.0})
    figures = run_figures("staleness_2_in_flight_2", tmp_path / "off", 0.2)
    assert figures["step_to_target"] == 4 and figures["train_s_to_target"] == pytest.approx(40.0)
    # the validations before training and at step 4 (the one that reached the target) count; step 8's only in all
    assert figures["wall_s_to_target"] == pytest.approx(7.0 + 40.0 + 9.0)
    assert figures["wall_s"] == pytest.approx(7.0 + 60.0 + 9.0 + 11.0)
    assert figures["trainer_idle_frac"] == pytest.approx(8 / 60)
    assert figures["rollout_idle_frac"] == pytest.approx(4 / 60)
    assert figures["staleness_max"] == 2.0 and figures["dropped_stale_dialogues"] == 0.0
    assert "simulator_idle_frac" not in figures  # two rollouts' simulator times overlap: no idle fraction

    _write_run(tmp_path / "never", {0: 0.20, 4: 0.25}, [10.0] * 4, False)
    figures = run_figures("sync", tmp_path / "never", 0.2)
    assert figures["step_to_target"] is None and figures["train_s_to_target"] is None


@pytest.mark.parametrize("simulator", ["scripted", "llm"])
def test_the_learning_command_names_only_options_bench_learning_has(simulator, tmp_path):
    args = parser().parse_args(["--simulator", simulator, "--median-ms", "2500"])
    command = learning_command(args, 3, "staleness_2_in_flight_2", tmp_path / "warm", tmp_path / "run")
    assert command[1:3] == ["-m", "bench.learning"]
    flags = {arg[2:].replace("-", "_"): value for arg, value in zip(command[3:], command[4:]) if arg.startswith("--")}
    assert set(flags) - {"work_dir", "out", "warm_model"} <= {f.name for f in dataclasses.fields(LearningSettings)}
    assert flags["seed"] == "3" and flags["simulator"] == simulator and flags["warm_model"] == str(tmp_path / "warm")
    assert flags["overrides"].split() == mode_overrides("staleness_2_in_flight_2")
    assert ("sim_latency_ms" in flags) == (simulator == "scripted")  # the LLM simulator's latency is its own
    if simulator == "scripted":
        assert flags["sim_latency_ms"] == "2500.0" and flags["sim_latency_sigma"] == "1.0"


@pytest.mark.processes  # write_result's platform.platform() runs `uname -p`
def test_report_only_tabulates_the_runs_in_the_work_directory(tmp_path, capsys):
    runs = tmp_path / "seed5" / "scripted"
    _write_run(runs / "sync", {0: 0.25, 4: 0.50}, [30.0, 30.0, 30.0, 30.0], False, {0: 10.0, 4: 10.0})
    _write_run(runs / "staleness_2_in_flight_2", {0: 0.25, 4: 0.50}, [30.0, 10.0, 10.0, 10.0], True,
               {0: 15.0, 4: 15.0})  # slower validations, beside the rollouts in flight
    outcomes = {"sync": ["completed", "hung_up", "hung_up", "completed"],
                "staleness_2_in_flight_2": ["hung_up", "completed", "completed", "completed"]}
    for mode, ends in outcomes.items():
        lines = [_val(4, i, end) for i, end in enumerate(ends)] + [_val(0, i, "hung_up") for i in range(4)]
        (runs / mode / "rollouts.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "result.json"
    main(["--report-only", "--seeds", "5", "--work", str(tmp_path), "--out", str(out)])
    result = json.loads(out.read_text())["runs"]["5"]
    assert result["sync"]["train_s"] == 120.0 and result["staleness_2_in_flight_2"]["train_s"] == 60.0
    assert result["staleness_2_in_flight_2"]["vs_sync"]["gained"] == 2
    assert result["staleness_2_in_flight_2"]["vs_sync"]["lost"] == 1
    printed = capsys.readouterr().out
    assert "sync's training time / its own, per run 2.00 (median 2.00)" in printed
    assert "sync's wall time with the validations / its own, per run 1.56 (median 1.56)" in printed  # 140 / 90
    assert json.loads(out.read_text())["between_runs"] is None  # one run per mode: no noise between runs to show


@pytest.mark.processes  # write_result's platform.platform() runs `uname -p`
def test_repeats_report_the_noise_between_runs_of_one_mode(tmp_path, capsys):
    runs = tmp_path / "seed5" / "scripted"
    ends = {"sync": "CHHC", "sync.repeat1": "CCHC", "staleness_2_in_flight_2": "HCCC",
            "staleness_2_in_flight_2.repeat1": "HHHC"}  # C completed, H hung up, per validation profile at step 4
    for name, outcomes in ends.items():
        _write_run(runs / name, {0: 0.25, 4: outcomes.count("C") / 4}, [10.0] * 4, name.startswith("staleness"),
                   {0: 5.0, 4: 5.0})
        lines = [_val(4, i, "completed" if end == "C" else "hung_up") for i, end in enumerate(outcomes)]
        lines += [_val(0, i, "hung_up") for i in range(4)]
        (runs / name / "rollouts.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "result.json"
    main(["--report-only", "--seeds", "5", "--repeats", "2", "--work", str(tmp_path), "--out", str(out)])
    result = json.loads(out.read_text())
    # each repeat pairs with the sync run of its own repeat: CCHC -> HHHC loses profiles 0 and 1
    repeat = result["runs"]["5"]["staleness_2_in_flight_2.repeat1"]
    assert repeat["mode"] == "staleness_2_in_flight_2" and repeat["repeat"] == 1
    assert (repeat["vs_sync"]["gained"], repeat["vs_sync"]["lost"]) == (0, 2)
    noise = result["between_runs"]
    assert noise["sync"]["last_cr"] == {"5": [0.5, 0.75]}
    assert [(p["gained"], p["lost"]) for p in noise["sync"]["repeat_vs_first"]["5"]] == [(1, 0)]  # CHHC -> CCHC
    assert [(p["gained"], p["lost"]) for p in noise["staleness_2_in_flight_2"]["repeat_vs_first"]["5"]] == [(0, 2)]
    # sync 0.5, 0.75 against 0.75, 0.25: mean difference -0.125; of the 6 splits of the four runs into two and two,
    # every one differs by at least 0.125 either way (0.125, 0.125, -0.375, 0.375, -0.125, -0.125)
    assert noise["staleness_2_in_flight_2"]["vs_sync"] == {"difference": pytest.approx(-0.125),
                                                           "p_two_sided": pytest.approx(1.0), "arrangements": 6}
    assert "mean last CR minus sync's -0.125 (permutation p 1, 6 arrangements)" in capsys.readouterr().out


def test_keep_done_keeps_only_a_finished_run_of_the_same_settings(tmp_path):
    args = parser().parse_args(["--keep-done", "--steps", "8", "--median-ms", "1000"])
    work = tmp_path / "run"
    assert not done_with_these_settings(args, 1, "one_step_off", work)  # nothing there yet
    _write_run(work, {0: 0.2, 4: 0.3}, [1.0] * 4, False)
    record = json.loads((work / "learning.json").read_text())
    settings = {"seed": 1, "steps": 8, "test_freq": 4, "simulator": "scripted", "sim_latency_ms": 1000.0,
                "sim_latency_sigma": 1.0, "overrides": " ".join(mode_overrides("one_step_off"))}
    (work / "learning.json").write_text(json.dumps({**record, "settings": settings}))
    assert done_with_these_settings(args, 1, "one_step_off", work)
    for seed, mode, flags in [(2, "one_step_off", []), (1, "sync", []), (1, "one_step_off", ["--median-ms", "2500"]),
                              (1, "one_step_off", ["--steps", "4"])]:
        other = parser().parse_args(["--keep-done", "--steps", "8", "--median-ms", "1000", *flags])
        with pytest.raises(ValueError, match="made with other settings"):
            done_with_these_settings(other, seed, mode, work)
