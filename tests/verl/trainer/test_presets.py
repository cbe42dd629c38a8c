"""The presets as YAML groups (verl/trainer/config/preset/) resolve to exactly the values of the shell presets they
replace, keep each value's origin, and refuse a wrong name, a removed variable or a value set in two places."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from tests.helpers.repo import REPO, SCENARIO_PATH
from verl.trainer.config_schema import ConfigError, compose_config
from verl.trainer.launch_settings import check_environment, main as launch_main
from verl.trainer.presets import SEED_KEYS, preset_names, preset_settings, resolve, trainer_overrides

# The values each preset of scripts/presets.sh resolved to at commit 61a6982 (scripts/main.sh --dry-run with
# MODEL_PATH=/models/Qwen2.5-14B-Instruct on the GPU presets, none on cpu and rehearsal, OUTPUT_DIR=outputs),
# less the scenario's absolute path and the simulators' URLs: computed once from that code, not from the YAML.
FIXTURE = json.loads((REPO / "tests" / "scripts" / "fixtures" / "presets_61a6982.json").read_text())
MODEL = "/models/Qwen2.5-14B-Instruct"
SCENARIO = str(SCENARIO_PATH)


def launcher_keys(preset: str) -> list[str]:
    """What scripts/main.sh passes as its own keys for the fixture's runs."""
    model = [f"actor_rollout_ref.model.path={MODEL}"] if preset.startswith("gpu") else [
        "actor_rollout_ref.model.path=outputs/models/{experiment}/tiny_model_warm", "data.max_prompt_length=96"]
    return [*model, f"rollout_loop.config.scenario={SCENARIO}",
            "data.train_files=outputs/prompt_data/{experiment}/train.parquet",
            "data.val_files=outputs/prompt_data/{experiment}/test.parquet",
            "rollout_loop.config.rollout_log_path=outputs/rollouts/{experiment}/rollouts.jsonl",
            "rollout_loop.config.val_metrics_path=outputs/evaluation/{experiment}/val_metrics.jsonl",
            "trainer.default_local_dir=outputs/checkpoints/{experiment}", "trainer.log_dir=outputs/logs/{experiment}"]


def expected_trainer(preset: str) -> dict[str, str]:
    expected = dict(FIXTURE[preset]["trainer"])
    if preset == "cpu":
        from utils.cpu_recipe import RECIPE

        # the recipe (utils/cpu_recipe.py, their one source) changed after 61a6982: 8 steps (was 4; the test
        # frequency follows: validation before training and after the last step), lr 2e-4 (was 4e-4), two
        # passes over each step's dialogues (was the trainer's default, one) and packed forwards (was padded)
        assert expected["actor_rollout_ref.actor.optim.lr"] == "0.0004" and RECIPE.lr == 2e-4
        assert "actor_rollout_ref.model.use_remove_padding" not in expected and RECIPE.use_remove_padding
        expected["actor_rollout_ref.model.use_remove_padding"] = "true"
        expected["actor_rollout_ref.actor.optim.lr"] = repr(RECIPE.lr)
        expected["trainer.total_training_steps"] = expected["trainer.test_freq"] = str(RECIPE.steps)
        expected["actor_rollout_ref.actor.ppo_epochs"] = str(RECIPE.ppo_epochs)
        # the shell preset chose the engine by what the running python imports, as {engine} does
        expected["actor_rollout_ref.rollout.name"] = "vllm" if importlib.util.find_spec("vllm") else "hf"
    return expected


@pytest.mark.parametrize("preset", ["cpu", "gpu", "gpu_lora", "rehearsal"])
def test_each_preset_resolves_to_the_values_of_the_shell_preset_it_replaces(preset):
    settings = resolve(preset, [("scripts/main.sh", launcher_keys(preset))])
    got = dict(arg.split("=", 1) for arg in trainer_overrides(settings))
    got.pop("rollout_loop.config.scenario")
    assert got == expected_trainer(preset)  # the same keys (none more, none less) with the same text
    launch = {name: settings[f"launch.{name.lower()}"].value
              for name in ("TRAIN_SAMPLES", "TEST_SAMPLES", "POLICY_GPUS")}
    launch["SEED"] = None if settings["launch.seed"].value == "null" else settings["launch.seed"].value
    assert launch == FIXTURE[preset]["launch"]
    # and the composed configs agree (types as the trainer reads them)
    old = compose_config([f"{k}={v}" for k, v in expected_trainer(preset).items()], config_name="sead_trainer")
    new = compose_config(trainer_overrides(settings), config_name="sead_trainer")
    old.rollout_loop.config.scenario = new.rollout_loop.config.scenario
    assert new == old


def test_every_value_keeps_its_origin_and_the_value_it_replaced():
    settings = resolve("gpu_lora", [("scripts/main.sh", [f"actor_rollout_ref.model.path={MODEL}"]),
                                    ("command line", ["rollout_loop.config.max_turns=9", "data.train_batch_size=30"])])
    assert settings["actor_rollout_ref.actor.optim.lr"].origin == "preset gpu_lora"
    assert settings["actor_rollout_ref.actor.optim.lr"].replaced.value == "1e-6"
    assert settings["actor_rollout_ref.actor.kl_loss_coef"].origin == "preset gpu"
    turns = settings["rollout_loop.config.max_turns"]
    assert (turns.value, turns.origin, turns.replaced.value, turns.replaced.origin) == ("9", "command line", "15",
                                                                                       "preset gpu")
    # values that follow others follow the command line: the mini-batch, the prompt data, the trainer's GPUs
    assert settings["actor_rollout_ref.actor.ppo_mini_batch_size"].value == "30"
    assert settings["launch.train_samples"].value == str(30 * 50)
    assert settings["launch.policy_gpus"].value == "0,1"


def test_launch_seed_seeds_the_trainer_unless_a_seed_key_is_given():
    cpu = resolve("cpu")
    assert {cpu[k].value for k in SEED_KEYS} == {"0"}
    assert not any(k in resolve("gpu") for k in SEED_KEYS)  # null: the trainer's own defaults
    mine = resolve("gpu", [("command line", ["launch.seed=3", "trainer.seed=5"])])
    assert mine["data.seed"].value == "3" and mine["data.seed"].origin == "launch.seed (command line)"
    assert mine["trainer.seed"].value == "5"


def test_the_cpu_presets_learning_values_have_one_source_the_recipe(monkeypatch):
    import dataclasses

    import utils.cpu_recipe as recipe

    own = preset_settings("cpu")
    from_recipe = {k for k, s in own.items() if s.origin == "preset cpu (utils.cpu_recipe)"}
    assert from_recipe == set(recipe.RECIPE.preset_values())
    text = (REPO / "verl/trainer/config/preset/cpu.yaml").read_text()
    assert not any(f"\n{key}:" in text for key in from_recipe), "a recipe value is copied into cpu.yaml"
    monkeypatch.setattr(recipe, "RECIPE", dataclasses.replace(recipe.RECIPE, steps=7))
    changed = resolve("cpu")
    assert changed["trainer.total_training_steps"].value == "7" and changed["trainer.test_freq"].value == "7"


def test_a_wrong_preset_name_is_refused_with_the_choices():
    assert preset_names() == ["cpu", "gpu", "gpu_lora", "rehearsal"]
    with pytest.raises(ConfigError, match="unknown preset 'tpu'; presets: cpu, gpu, gpu_lora, rehearsal"):
        resolve("tpu")


def test_a_preset_that_sets_a_recipe_value_again_is_refused(tmp_path, monkeypatch):
    import verl.trainer.presets as presets

    (tmp_path / "mine.yaml").write_text("recipe: utils.cpu_recipe\ntrainer.total_training_steps: '9'\n")
    (tmp_path / "loop.yaml").write_text("inherits: loop\n")
    monkeypatch.setattr(presets, "PRESET_DIR", tmp_path)
    with pytest.raises(ConfigError, match="sets trainer.total_training_steps, which its recipe"):
        resolve("mine")
    with pytest.raises(ConfigError, match="inherits itself"):
        resolve("loop")


def test_a_preset_is_named_not_reached_by_a_path(tmp_path):
    (tmp_path / "mine.yaml").write_text("trainer.total_training_steps: \"3\"\n")
    with pytest.raises(ConfigError, match="unknown preset"):  # from the preset folder up to / and down to it
        resolve("/".join([".."] * 12) + str(tmp_path / "mine"))


def test_the_old_preset_variables_are_refused_naming_their_key(monkeypatch, capsys):
    assert check_environment({"PRESET": "gpu", "MODEL_PATH": "/m"}) is None  # process-level inputs stay
    with pytest.raises(ConfigError, match=r"MAX_TURNS \(now rollout_loop.config.max_turns=...\)"):
        check_environment({"MAX_TURNS": "12"})
    monkeypatch.setenv("SEAD_GPU_MAX_TURNS", "12")
    assert launch_main(["gpu"]) == 2
    assert "SEAD_GPU_MAX_TURNS (now rollout_loop.config.max_turns=...)" in capsys.readouterr().err


def test_generic_names_in_the_environment_are_reported_as_not_read_instead_of_refused(monkeypatch, capsys):
    said = check_environment({"SEED": "7", "LOG_DIR": "/var/log/mine"})
    assert said and "SEED (now launch.seed=...)" in said and "LOG_DIR (now trainer.log_dir=...)" in said
    with pytest.raises(ConfigError, match=re.escape("unset STEPS (now trainer.total_training_steps=...) and")):
        check_environment({"SEED": "7", "STEPS": "20"})  # a distinctive old name among them is still refused
    monkeypatch.setenv("DATA_DIR", "/data")
    assert launch_main(["cpu"]) == 0
    out = capsys.readouterr()
    assert "does not read DATA_DIR (now data.train_files and data.val_files=...)" in out.err


def test_the_trainer_takes_preset_name_under_its_other_key_value_arguments():
    from verl.trainer.cli_overrides import check_overrides

    argv = check_overrides(["--config-name", "sead_trainer", "preset=gpu", "format_prompt=support_desk",
                            f"actor_rollout_ref.model.path={MODEL}", "rollout_loop.config.max_turns=9"])
    assert argv[:2] == ["--config-name", "sead_trainer"]
    got = dict(a.split("=", 1) for a in argv[2:])
    assert len(got) == len(argv) - 2 and not any(k.startswith("launch.") for k in got)
    assert got["rollout_loop.config.max_turns"] == "9" and got["actor_rollout_ref.actor.optim.lr"] == "1e-6"
    assert got["trainer.experiment_name"] == "Qwen2.5-14B-Instruct_support_desk"
    compose_config(argv[2:], config_name="sead_trainer")
    with pytest.raises(ConfigError, match="unknown preset 'gpu2'"):
        check_overrides(["--config-name", "sead_trainer", "preset=gpu2"])


@pytest.mark.processes
def test_the_trainers_dry_run_prints_each_value_with_its_origin_and_trains_nothing():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", "--config-name", "sead_trainer",
                           "preset=gpu_lora", "rollout_loop.config.max_turns=12", "--dry-run"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("settings (preset gpu_lora over sead_trainer.yaml")
    assert "  rollout_loop.config.max_turns=12    (command line, replacing 15 of preset gpu)" in lines
    assert "  actor_rollout_ref.actor.optim.lr=1e-5    (preset gpu_lora, replacing 1e-6 of preset gpu)" in lines


def test_main_sh_refuses_a_second_scenario_in_any_spelling_and_shared_gpus():
    from verl.trainer.launch_settings import check_launch

    launcher = [f"rollout_loop.config.scenario={SCENARIO}"]
    settings = resolve("gpu", [("scripts/main.sh", launcher)])
    for same in (f"rollout_loop.config.scenario={SCENARIO}", "format_prompt=outbound_ad_trial",
                 f"reward.kwargs.scenario={SCENARIO}"):
        check_launch(settings, launcher, [same], {})
    for other in ("format_prompt=support_desk", "+reward.kwargs.scenario=x.yaml"):
        with pytest.raises(ConfigError, match="disagrees with SCENARIO="):
            check_launch(settings, launcher, [other], {})
    with pytest.raises(ConfigError, match="GPU 5 is in both launch.policy_gpus=0,1,2,3,4,5 and SIM_GPUS=5,6"):
        check_launch(settings, launcher, [], {"SIM_GPUS": "5,6"})


def test_checkpoints_at_the_step_count_are_called_out(tmp_path):
    from verl.trainer.launch_settings import nothing_to_train

    from utils.cpu_recipe import RECIPE

    (tmp_path / f"global_step_{RECIPE.steps}").mkdir()
    at = resolve("cpu", [("command line", [f"trainer.default_local_dir={tmp_path}"])])
    said = nothing_to_train(at, {})
    assert f"already holds step {RECIPE.steps} and trainer.total_training_steps={RECIPE.steps}" in said
    assert nothing_to_train(at, {"ITERATIONS": "2"}) is None
    more = resolve("cpu", [("command line", [f"trainer.default_local_dir={tmp_path}",
                                             f"trainer.total_training_steps={RECIPE.steps + 1}"])])
    assert nothing_to_train(more, {}) is None
