"""The vLLM rollout keys of ppo_trainer.yaml: defaults, and errors that name the key (no vLLM needed)."""
import importlib.util

import pytest

from verl.trainer.config_schema import ConfigError, compose_config
from verl.trainer.config_validation import build_config, load_config

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture()
def paths(paths: list[str]) -> list[str]:
    return [*paths, "trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.name=vllm"]


def test_defaults_keep_hf_and_describe_a_colocated_engine():
    rollout = build_config(compose_config()).actor_rollout_ref.rollout
    assert rollout.name == "hf"
    assert (rollout.tensor_model_parallel_size, rollout.dtype, rollout.free_cache_engine) == (1, "auto", True)
    assert rollout.enable_prefix_caching and not rollout.calculate_log_probs and rollout.max_model_len is None


@pytest.mark.parametrize("override, message", [
    ("tensor_model_parallel_size=3", r"tensor_model_parallel_size \(3\) must be >= 1 and divide the DP world size"),
    ("tensor_model_parallel_size=0", r"tensor_model_parallel_size \(0\) must be >= 1"),
    ("gpu_memory_utilization=1.5", r"gpu_memory_utilization must be in \(0, 1\], got 1.5"),
    ("max_num_seqs=0", r"max_num_seqs must be positive, got 0"),
    ("max_num_batched_tokens=-1", r"max_num_batched_tokens must be positive or null"),
    ("max_model_len=100", r"max_model_len \(100\) must hold prompt_length \+ response_length \(144\)"),
])
def test_bad_engine_keys_are_named(paths, override, message):
    with pytest.raises(ConfigError, match=rf"actor_rollout_ref\.rollout\.{message}"):
        load_config(compose_config(paths + [f"actor_rollout_ref.rollout.{override}"]))


def test_bad_engine_dtype_is_named(paths):
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.rollout\.dtype must be one of"):
        build_config(compose_config(paths + ["actor_rollout_ref.rollout.dtype=fp8"]))


@pytest.mark.skipif(HAS_VLLM, reason="this Python has vLLM")
def test_vllm_rollout_without_vllm_says_how_to_get_it(paths):
    with pytest.raises(ConfigError, match=r"rollout\.name=vllm needs vLLM in this Python environment \(make vllm-env"):
        load_config(compose_config(paths + ["actor_rollout_ref.rollout.tensor_model_parallel_size=2"]))


@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM: run with the vLLM environment's python (make vllm-env)")
def test_vllm_rollout_config_passes_where_vllm_is_installed(paths):
    cfg = load_config(compose_config(paths + ["actor_rollout_ref.rollout.tensor_model_parallel_size=2"]))
    assert cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 2
