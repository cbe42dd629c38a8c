"""Config keys of padding-free training, token-budget micro-batches and CPU offload (veRL's names)."""
import re

import pytest

from verl.trainer.config_schema import ConfigError, compose_config
from verl.trainer.config_validation import load_config


def test_defaults_are_off_and_log_prob_budgets_follow_the_actor(paths):
    cfg = load_config(compose_config(paths))
    arr = cfg.actor_rollout_ref
    assert not arr.model.use_remove_padding and not arr.actor.use_dynamic_bsz and not cfg.critic.model.use_remove_padding
    assert not arr.actor.fsdp_config.param_offload and not arr.ref.fsdp_config.param_offload
    cfg = load_config(compose_config(paths + ["actor_rollout_ref.actor.use_dynamic_bsz=true",
                                              "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=9000"]))
    arr = cfg.actor_rollout_ref
    assert arr.rollout.log_prob_use_dynamic_bsz and arr.ref.log_prob_use_dynamic_bsz and cfg.critic.use_dynamic_bsz
    assert arr.rollout.log_prob_max_token_len_per_gpu == arr.ref.log_prob_max_token_len_per_gpu == 9000
    assert cfg.critic.forward_max_token_len_per_gpu == cfg.critic.ppo_max_token_len_per_gpu == 32768


def test_dynamic_batch_size_skips_the_micro_batch_divisibility_rule(paths):
    overrides = paths + ["actor_rollout_ref.rollout.n=2", "trainer.n_gpus_per_node=2",
                         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"]
    with pytest.raises(ConfigError, match="ppo_micro_batch_size_per_gpu"):
        load_config(compose_config(overrides))
    cfg = load_config(compose_config(overrides + ["actor_rollout_ref.actor.use_dynamic_bsz=true"]))
    assert cfg.actor_rollout_ref.actor.use_dynamic_bsz


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
                                 "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
                                 "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"])
def test_a_token_budget_in_use_must_be_positive(paths, key):
    with pytest.raises(ConfigError, match=re.escape(key) + " must be a positive number of tokens"):
        load_config(compose_config(paths + ["actor_rollout_ref.actor.use_dynamic_bsz=true", f"{key}=0"]))
    load_config(compose_config(paths + [f"{key}=0"]))  # not in use: not checked


def test_critic_budgets_are_checked_only_with_a_critic(paths):
    overrides = paths + ["critic.use_dynamic_bsz=true", "critic.forward_max_token_len_per_gpu=-1"]
    with pytest.raises(ConfigError, match=r"critic\.forward_max_token_len_per_gpu must be a positive"):
        load_config(compose_config(overrides))
    load_config(compose_config(overrides + ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2"]))


def test_offload_keys_live_where_verl_reads_them(paths):
    cfg = load_config(compose_config(paths + [
        "actor_rollout_ref.actor.fsdp_config.param_offload=true",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
        "actor_rollout_ref.ref.fsdp_config.param_offload=true",
        "critic.model.fsdp_config.param_offload=true", "critic.model.fsdp_config.optimizer_offload=true",
        "critic.model.use_remove_padding=true", "actor_rollout_ref.model.use_remove_padding=true"]))
    assert cfg.actor_rollout_ref.actor.fsdp_config.optimizer_offload and cfg.critic.model.fsdp_config.param_offload
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.ref\.fsdp_config\.optimizer_offload is not a config"):
        load_config(compose_config(paths + ["+actor_rollout_ref.ref.fsdp_config.optimizer_offload=true"]))
