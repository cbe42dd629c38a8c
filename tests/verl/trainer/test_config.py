"""ppo_trainer.yaml vs the config dataclasses: key-by-key agreement, comments, and clear validation errors."""
import dataclasses
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from verl.trainer.config_schema import CONFIG_DIR, ConfigError, PPOTrainerConfig, compose_config
from verl.trainer.config_validation import build_config, load_config

YAML_PATH = CONFIG_DIR / "ppo_trainer.yaml"
# mappings whose keys are data, not config keys: plug-in kwargs, and the label -> weight table
FREE_FORM = {"reward.kwargs", "rollout_loop.config", "algorithm.diagnosis_reweight.weights"}


def _yaml_job_tree() -> dict:
    raw = OmegaConf.to_container(OmegaConf.load(YAML_PATH), resolve=False)
    raw.pop("defaults")
    raw.pop("hydra")
    return raw


def _walk_yaml(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and dotted not in FREE_FORM:
            out.update(_walk_yaml(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def _walk_dataclass(instance, prefix: str = "") -> dict:
    out = {}
    for f in dataclasses.fields(instance):
        dotted = f"{prefix}{f.name}"
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value):
            out.update(_walk_dataclass(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def test_yaml_and_dataclasses_have_the_same_keys_and_defaults():
    yaml_leaves = _walk_yaml(_yaml_job_tree())
    dc_leaves = _walk_dataclass(PPOTrainerConfig())
    assert sorted(set(yaml_leaves) - set(dc_leaves)) == [], "YAML keys without a dataclass field"
    assert sorted(set(dc_leaves) - set(yaml_leaves)) == [], "dataclass fields without a YAML key"
    for key, value in yaml_leaves.items():
        if isinstance(value, str) and "${" in value:
            continue
        if key in ("trainer.log_dir", "trainer.default_local_dir"):
            continue
        assert value == dc_leaves[key], f"default of {key} differs: yaml {value!r} vs dataclass {dc_leaves[key]!r}"


def test_every_yaml_key_has_a_comment_above_it():
    lines = YAML_PATH.read_text().splitlines()
    key_re = re.compile(r"^(\s*)([A-Za-z_][\w]*):")
    uncommented = []
    for i, line in enumerate(lines):
        m = key_re.match(line)
        if not m:
            continue
        above = lines[i - 1].strip() if i > 0 else ""
        if not above.startswith("#"):
            uncommented.append(f"line {i + 1}: {m.group(2)}")
    assert uncommented == []


def test_default_config_builds(tmp_path: Path):
    cfg = build_config(compose_config())
    assert cfg.actor_rollout_ref.rollout.prompt_length == cfg.data.max_prompt_length
    assert cfg.critic.rollout_n == cfg.actor_rollout_ref.rollout.n
    assert cfg.world_size == 1


def test_valid_config_passes(paths):
    cfg = load_config(compose_config(paths + ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4"]))
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.need_critic is False


def test_unknown_nested_key_is_named():
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.ppo_mini_batchsize is not a config key"):
        build_config(compose_config(["+actor_rollout_ref.actor.ppo_mini_batchsize=3"]))


def test_unknown_key_in_plain_mapping_is_named():
    raw = OmegaConf.to_container(compose_config(), resolve=True)
    raw["trainer"]["checkpoint_every"] = 3
    with pytest.raises(ConfigError, match=r"^trainer\.checkpoint_every is not a config key"):
        build_config(raw)


def test_free_form_sections_accept_any_key(paths):
    cfg = load_config(compose_config(paths + ["+reward.kwargs.k=3", "+rollout_loop.config.max_turns=5"]))
    assert cfg.reward.kwargs == {"k": 3}
    assert cfg.rollout_loop.config == {"max_turns": 5}


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match=r"data\.train_batch_size must be an integer, got 'abc'"):
        build_config(compose_config(["data.train_batch_size=abc"]))
    with pytest.raises(ConfigError, match=r"trainer\.device must be one of"):
        build_config(compose_config(["trainer.device=tpu"]))


def test_missing_model_path_is_a_clear_error(paths):
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.model\.path is required"):
        load_config(compose_config(paths[1:]))
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.model\.path='/nonexistent/m' is not a directory"):
        load_config(compose_config(paths[1:] + ["actor_rollout_ref.model.path=/nonexistent/m"]))


def test_missing_train_files_is_a_clear_error(paths):
    with pytest.raises(ConfigError, match=r"data\.train_files is required"):
        load_config(compose_config(paths[:1]))


def test_batch_not_divisible_by_mini_batch_names_numbers(paths):
    with pytest.raises(ConfigError, match=r"\(6\*2=12\) must be divisible by .*ppo_mini_batch_size \* rollout\.n "
                                          r"\(4\*2=8\)"):
        load_config(compose_config(paths + ["data.train_batch_size=6", "actor_rollout_ref.rollout.n=2"]))


def test_batch_not_divisible_by_world_size_names_numbers(paths):
    with pytest.raises(ConfigError, match=r"\(6\*1=6\) must be divisible by the DP world size .*\(1\*4=4\)"):
        load_config(compose_config(paths + ["data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=3",
                                            "trainer.n_gpus_per_node=4"]))


def test_micro_batch_must_divide_per_rank_mini_batch(paths):
    with pytest.raises(ConfigError, match=r"mini-batch per rank \(8/2=4 rows\) must be divisible by "
                                          r"actor_rollout_ref\.actor\.ppo_micro_batch_size_per_gpu \(3\)"):
        load_config(compose_config(paths + ["actor_rollout_ref.rollout.n=2", "trainer.n_gpus_per_node=2",
                                            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"]))


def test_group_estimator_needs_n_above_one(paths):
    with pytest.raises(ConfigError, match=r"adv_estimator=grpo .*rollout\.n >= 2 \(got 1\)"):
        load_config(compose_config(paths + ["algorithm.adv_estimator=grpo"]))


def test_resume_path_needs_a_path(paths):
    with pytest.raises(ConfigError, match=r"resume_mode=resume_path needs trainer\.resume_from_path"):
        load_config(compose_config(paths + ["trainer.resume_mode=resume_path"]))


def test_rollout_lengths_must_match_data_lengths(paths):
    with pytest.raises(ConfigError, match=r"rollout\.response_length \(7\) must equal data\.max_response_length"):
        load_config(compose_config(paths + ["actor_rollout_ref.rollout.response_length=7"]))


def test_loss_scale_factor_must_be_positive_and_the_critic_inherits_it(paths):
    cfg = load_config(compose_config(paths + ["actor_rollout_ref.actor.loss_scale_factor=512"]))
    assert cfg.actor_rollout_ref.actor.loss_scale_factor == cfg.critic.loss_scale_factor == 512.0
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.loss_scale_factor must be > 0 or null"):
        load_config(compose_config(paths + ["actor_rollout_ref.actor.loss_scale_factor=0"]))
