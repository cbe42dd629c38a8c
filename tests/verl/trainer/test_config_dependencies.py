"""Keys that need other keys are checked when the config loads, naming the key to set (verl.trainer.config_dependencies).

Before, `algorithm.adv_estimator=turn_mixed` alone loaded and failed after the first rollout ("needs the per-turn
rewards batch['turn_scores']"), and `algorithm.diagnosis_reweight.enable` with a reward that writes no labels
failed there too; both now fail at load, the first naming `reward.kwargs.turn_weights.*`.
"""
from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from verl.trainer.config_schema import ConfigError, compose_config
from verl.trainer.config_validation import load_config
from verl.trainer.ppo.plugins import BatchOutputs, declare_outputs

REPO = Path(__file__).resolve().parents[3]
D = "algorithm.diagnosis_reweight"


def _load(paths: list[str], *overrides: str, config_name: str = "sead_trainer"):
    return load_config(compose_config([*paths, *overrides], config_name=config_name), check_paths=False)


def undeclared_reward(data, tokenizer, **kwargs):
    """A reward plug-in that says nothing about what it writes."""
    raise AssertionError("never called at load")


@declare_outputs(lambda kwargs: BatchOutputs(written=frozenset({"turn_scores"}) if kwargs.get("on") else frozenset(),
                                             enabled_by={"turn_scores": "reward.kwargs.on=true"}))
def switchable_reward(data, tokenizer, on=False):
    """A reward plug-in that writes per-turn rewards when asked."""
    raise AssertionError("never called at load")


def test_turn_mixed_without_per_turn_rewards_names_the_reward_keys(paths):
    with pytest.raises(ConfigError) as err:
        _load(paths, "algorithm.adv_estimator=turn_mixed")
    message = str(err.value)
    assert message.startswith("algorithm.adv_estimator=turn_mixed needs the per-turn rewards (batch entry "
                              "'turn_scores'): reward.path=llm_agent.reward.compute_reward writes them when")
    assert all(f"reward.kwargs.turn_weights.{name}" in message for name in ("state_change", "stage_progress", "format"))
    assert _load(paths, "algorithm.adv_estimator=turn_mixed",
                 "reward.kwargs.turn_weights.state_change=1.0").algorithm.adv_estimator == "turn_mixed"
    with pytest.raises(ConfigError, match=r"reward\.kwargs\.turn_weights\.state_change must be a finite number"):
        _load(paths, "algorithm.adv_estimator=turn_mixed", "reward.kwargs.turn_weights.state_change=nan")


def test_a_reward_that_writes_neither_entry_is_named(paths):
    # the engine's built-in task reward writes no per-turn rewards and no labels
    with pytest.raises(ConfigError, match=r"needs the per-turn rewards .* which neither "
                                          r"reward\.path=verl\.tasks\.repeat_letter\.compute_reward nor "
                                          r"rollout_loop\.path=null writes"):
        _load(paths, "algorithm.adv_estimator=turn_mixed", "actor_rollout_ref.rollout.n=2", config_name="ppo_trainer")
    with pytest.raises(ConfigError, match=rf"{D}\.enable=true needs the failure labels of the agent turns "
                                          r"\(batch entry 'turn_labels'\), which neither"):
        _load(paths, f"{D}.enable=true", f"+{D}.weights={{false_claim:1.5}}", config_name="ppo_trainer")
    # the dialogue reward always writes the labels
    assert _load(paths, f"{D}.enable=true", f"+{D}.weights={{false_claim:1.5}}").algorithm.diagnosis_reweight.enable


def test_a_plugin_declaration_decides_and_an_undeclared_one_is_warned_about(paths, caplog):
    here = __name__
    mixed = ["algorithm.adv_estimator=turn_mixed", "actor_rollout_ref.rollout.n=2"]
    with pytest.raises(ConfigError, match=rf"reward\.path={here}\.switchable_reward writes them when "
                                          r"reward\.kwargs\.on=true"):
        _load(paths, *mixed, f"reward.path={here}.switchable_reward", config_name="ppo_trainer")
    _load(paths, *mixed, f"reward.path={here}.switchable_reward", "+reward.kwargs.on=true", config_name="ppo_trainer")
    with caplog.at_level(logging.WARNING, logger="verl.trainer.config_dependencies"):
        _load(paths, *mixed, f"reward.path={here}.undeclared_reward", config_name="ppo_trainer")
    assert any(f"reward.path={here}.undeclared_reward does not declare what it writes" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(ConfigError, match=r"reward\.path='no_such_module\.fn': cannot import module"):
        _load(paths, *mixed, "reward.path=no_such_module.fn", config_name="ppo_trainer")


def test_settings_without_effect_are_warned_about(paths, caplog):
    with caplog.at_level(logging.WARNING, logger="verl.trainer.config_dependencies"):
        _load(paths, f"+{D}.weights={{false_claim:1.5}}", "algorithm.kl_ctrl.type=adaptive", "trainer.critic_warmup=2")
    messages = " | ".join(r.getMessage() for r in caplog.records)
    assert f"{D}.enable=false: no advantage is reweighted" in messages
    assert "algorithm.kl_ctrl.type=adaptive controls the in-reward KL penalty, which is off" in messages
    assert "trainer.critic_warmup=2 without a critic" in messages


def test_rollout_correction_needs_the_rollout_log_probs(paths):
    with pytest.raises(ConfigError, match="set actor_rollout_ref.rollout.calculate_log_probs=true"):
        _load(paths, "algorithm.rollout_correction.rollout_is=token")
    _load(paths, "algorithm.rollout_correction.rollout_is=token", "actor_rollout_ref.rollout.calculate_log_probs=true")


@pytest.mark.processes
def test_the_trainer_refuses_turn_mixed_alone_before_starting_anything(tmp_path):
    model, data = tmp_path / "model", tmp_path / "train.parquet"
    model.mkdir()
    data.write_bytes(b"x")
    done = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", "--config-name", "sead_trainer",
                           f"actor_rollout_ref.model.path={model}", f"data.train_files={data}",
                           f"data.val_files={data}", "algorithm.adv_estimator=turn_mixed"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    assert "config error: algorithm.adv_estimator=turn_mixed needs the per-turn rewards" in done.stderr
    assert "reward.kwargs.turn_weights.state_change=1.0" in done.stderr and "ray" not in done.stderr.lower()
