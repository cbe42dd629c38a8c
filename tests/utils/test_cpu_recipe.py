"""The CPU learning recipe: one definition read by the CPU preset, the demo's model build and bench/learning.py."""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers.repo import REPO, SCENARIO_PATH
from utils.cpu_recipe import RECIPE, WARM_KEY_FILE, build_warm_model, warm_start_key

SMALL = dataclasses.replace(RECIPE, sft_dialogues=8, sft_steps=2, max_turns=3)


@pytest.mark.processes
def test_the_cpu_preset_and_the_learning_benchmark_take_their_settings_from_the_recipe():
    from bench.learning import LearningSettings

    printed = subprocess.run([sys.executable, "-m", "utils.cpu_recipe", "preset"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout
    values = dict(line.split(" ", 1) for line in printed.splitlines())
    assert values == RECIPE.preset_values()
    assert values["trainer.total_training_steps"] == "8"
    assert values["actor_rollout_ref.model.use_remove_padding"] == "true"  # the GPU preset's packed forwards
    assert values["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] == str(
        RECIPE.ppo_mini_prompts * RECIPE.group_size // 2)
    env = {k: v for k, v in os.environ.items() if k not in ("PRESET", "MODEL_PATH")} | {"PYTHON": sys.executable}
    dry = subprocess.run(["bash", "scripts/main.sh", "--dry-run"], cwd=REPO, env=env, capture_output=True,
                         text=True, check=True).stdout
    for key, value in values.items():  # every recipe value reaches the CPU preset, marked as the recipe's
        assert f"  {key}={value}    (preset cpu (utils.cpu_recipe))" in dry.splitlines(), (key, value)
    assert f"actor_rollout_ref.actor.optim.lr={values['actor_rollout_ref.actor.optim.lr']}" in dry
    assert "trainer.seed=0" in dry
    bench = LearningSettings()
    assert {f.name: getattr(bench, f.name) for f in dataclasses.fields(RECIPE) if f.name != "steps"} == \
        {f.name: getattr(RECIPE, f.name) for f in dataclasses.fields(RECIPE) if f.name != "steps"}
    assert bench.steps == 16


@pytest.mark.extended  # 43 s measured on a quiet box: make test-extended (CI), out of make test's 20 minutes
@pytest.mark.slow  # two torchrun launches of the warm start's SFT: 83 s on a loaded 2-core box
def test_the_warm_model_is_reused_from_a_moved_checkout_and_rebuilt_when_its_inputs_change(tmp_path):
    scenario = tmp_path / "a" / SCENARIO_PATH.name
    scenario.parent.mkdir()
    library = (SCENARIO_PATH.parent / "../../../../assets/client_action.jsonl").resolve()
    scenario.write_text(SCENARIO_PATH.read_text().replace("../../../../assets/client_action.jsonl", str(library)))
    prompt = "You are Mia. Answer in the tags."
    warm = build_warm_model(tmp_path / "a" / "models", scenario, prompt, seed=0, recipe=SMALL)
    assert warm.name == "tiny_model_warm" and (warm / "sft_log.json").is_file()
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # the checkout moved: every path differs, no content does
    moved = tmp_path / "b" / "models" / "tiny_model_warm"
    stamp = (moved / "sft_log.json").stat().st_mtime_ns
    assert build_warm_model(tmp_path / "b" / "models", tmp_path / "b" / scenario.name, prompt, seed=0,
                            recipe=SMALL) == moved
    assert (moved / "sft_log.json").stat().st_mtime_ns == stamp, "rebuilt although nothing it is made of changed"
    assert warm_start_key(SMALL, scenario, 0, prompt, 2) == warm_start_key(SMALL, tmp_path / "b" / scenario.name,
                                                                           0, prompt, 2)
    changed = tmp_path / "b" / scenario.name
    changed.write_text(changed.read_text().replace("Free credit? There's always a catch.",
                                                   "Free credit? What is the catch?"))
    build_warm_model(tmp_path / "b" / "models", changed, prompt, seed=0, recipe=SMALL)
    assert (moved / "sft_log.json").stat().st_mtime_ns != stamp, "the scenario's content changed: rebuilt"
    key = (moved / WARM_KEY_FILE).read_text()
    assert key.split("\n")[0] == warm_start_key(SMALL, changed, 0, prompt, 2)
    assert warm_start_key(SMALL, changed, 1, prompt, 2) != warm_start_key(SMALL, changed, 0, prompt, 2)
    assert build_warm_model(tmp_path / "c", changed, prompt, seed=0, recipe=SMALL, steps=0).name == "tiny_model"
