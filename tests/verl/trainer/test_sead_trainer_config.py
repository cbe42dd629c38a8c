"""sead_trainer.yaml: composes on top of ppo_trainer.yaml, mirrors GenerationConfig key by key, comments."""
import dataclasses
import inspect
import re

from omegaconf import OmegaConf

from verl.trainer.config_schema import CONFIG_DIR, compose_config
from verl.trainer.config_validation import build_config

YAML_PATH = CONFIG_DIR / "sead_trainer.yaml"


def _leaves(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and dotted not in ("stage_hit_rates", "cache.stage_hit_rates", "reward", "judges"):
            out.update(_leaves(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def _dataclass_leaves(cls, prefix=""):
    out = {}
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            out.update(_dataclass_leaves(type(default), f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = default
    return out


def test_composes_and_validates_as_a_trainer_config(tmp_path):
    config = compose_config([f"actor_rollout_ref.model.path={tmp_path}"], config_name="sead_trainer")
    typed = build_config(config)
    assert typed.rollout_loop.path == "llm_agent.generation.LLMGenerationManager"
    assert typed.reward.path == "llm_agent.reward.compute_reward"
    assert typed.algorithm.adv_estimator == "grpo"
    resolved = OmegaConf.to_container(config, resolve=True)
    assert resolved["rollout_loop"]["config"]["max_response_length"] == resolved["data"]["max_response_length"]
    assert resolved["reward"]["kwargs"]["scenario"] == resolved["rollout_loop"]["config"]["scenario"]


def test_rollout_loop_config_mirrors_generation_config_and_parses():
    from llm_agent.rollout.config import GenerationConfig

    config = compose_config(["actor_rollout_ref.model.path=/x"], config_name="sead_trainer")
    loop_cfg = OmegaConf.to_container(config.rollout_loop.config, resolve=True)
    yaml_keys = set(_leaves(loop_cfg))
    dc_keys = set(_dataclass_leaves(GenerationConfig))
    assert sorted(yaml_keys - dc_keys) == [], "YAML keys without a GenerationConfig field"
    assert sorted(dc_keys - yaml_keys) == [], "GenerationConfig fields without a YAML key"
    parsed = GenerationConfig.from_dict(loop_cfg)
    assert parsed.max_response_length == config.data.max_response_length
    assert parsed.cache.stage_hit_rates == {0: 0.9, 1: 0.5, 2: 0.2, 3: 0.0}


def test_reward_kwargs_are_parameters_of_the_reward_function():
    from llm_agent.reward import compute_reward

    config = compose_config(["actor_rollout_ref.model.path=/x"], config_name="sead_trainer")
    params = inspect.signature(compute_reward).parameters
    assert set(config.reward.kwargs) <= set(params)
    assert dict(config.reward.kwargs.weights)["completion"] == 10.0


def test_every_key_has_a_comment_above_it():
    lines = YAML_PATH.read_text().splitlines()
    key_re = re.compile(r"^(\s*)([A-Za-z_][\w]*):")
    uncommented = [f"line {i + 1}: {m.group(2)}" for i, line in enumerate(lines)
                   if (m := key_re.match(line)) and not (lines[i - 1].strip().startswith("#") if i else False)
                   and m.group(2) not in ("defaults",)]
    assert uncommented == []


# keys whose YAML value is derived from another section by interpolation (the trainer wires them), and the one key
# without a default; every other rollout_loop.config value must be the dataclass default
DERIVED = {"max_response_length": "${data.max_response_length}",
           "cache.path": "${trainer.default_local_dir}/user_response_cache.jsonl",
           "rollout_log_path": "outputs/rollouts/${trainer.experiment_name}/rollouts.jsonl"}
REQUIRED = {"scenario"}


def test_every_rollout_loop_value_is_the_dataclass_default():
    from llm_agent.rollout.config import GenerationConfig

    config = compose_config(["actor_rollout_ref.model.path=/x"], config_name="sead_trainer")
    raw = _leaves(OmegaConf.to_container(config.rollout_loop.config, resolve=False))
    defaults = _dataclass_leaves(GenerationConfig)
    assert {k: raw[k] for k in DERIVED} == DERIVED
    assert all(defaults[k] is None for k in REQUIRED) and raw["scenario"]
    differing = {k: (v, defaults[k]) for k, v in raw.items() if k not in DERIVED.keys() | REQUIRED and v != defaults[k]}
    assert differing == {}, "sead_trainer.yaml value != dataclass default (yaml, default)"
    resolved = OmegaConf.to_container(config.rollout_loop.config, resolve=True)
    assert resolved["max_response_length"] == defaults["max_response_length"]
    # the YAML builds the same config as the defaults plus the scenario and the derived values
    from_yaml = GenerationConfig.from_dict(resolved)
    from_defaults = GenerationConfig.from_dict({
        "scenario": resolved["scenario"], "max_response_length": resolved["max_response_length"],
        "rollout_log_path": resolved["rollout_log_path"], "cache": {"path": resolved["cache"]["path"]}})
    assert from_yaml == from_defaults
