"""Command-line overrides before Hydra: a plain typo gets a "did you mean", and format_prompt=<name> selects a
scenario file instead of failing as a Hydra config group."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl.trainer.cli_overrides import SCENARIO_DIR, check_overrides, config_name_from_argv
from verl.trainer.config_schema import ConfigError, compose_config

REPO = Path(__file__).resolve().parents[3]


def test_plain_typo_names_the_closest_key():
    with pytest.raises(ConfigError, match=r"unknown key trainer\.total_trainng_steps \(did you mean "
                                          r"trainer\.total_training_steps\?\)"):
        check_overrides(["trainer.total_trainng_steps=3"])
    with pytest.raises(ConfigError, match=r"did you mean actor_rollout_ref\?"):
        check_overrides(["actor_rolout_ref.actor.optim.lr=1e-6"])


def test_valid_plus_and_hydra_overrides_pass_unchanged():
    argv = ["--config-name", "sead_trainer", "trainer.total_training_steps=3", "+trainer.extra=1",
            "hydra.run.dir=.", "rollout_loop.config.max_turns=5"]
    assert check_overrides(argv) == argv
    assert config_name_from_argv(argv) == "sead_trainer" and config_name_from_argv(["-cn=x"]) == "x"


@pytest.mark.parametrize("form", ["format_prompt", "+format_prompt"])
def test_format_prompt_selects_the_scenario_file(form):
    argv = check_overrides(["--config-name", "sead_trainer", f"{form}=inbound_support"])
    assert argv[-1] == f"rollout_loop.config.scenario={SCENARIO_DIR / 'inbound_support.yaml'}"
    cfg = compose_config(argv[2:], config_name="sead_trainer")
    assert cfg.rollout_loop.config.scenario.endswith("format_prompt/inbound_support.yaml")
    assert "format_prompt" not in cfg


def test_unknown_scenario_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"did you mean inbound_support\?\); scenarios: inbound_support, "
                                          r"outbound_ad_trial"):
        check_overrides(["format_prompt=inbound_suport"])


@pytest.mark.processes
def test_the_entry_point_prints_one_config_error_line_for_a_typo():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", "--config-name", "sead_trainer",
                           "trainer.total_trainng_steps=3"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("config error: unknown key trainer.total_trainng_steps")
