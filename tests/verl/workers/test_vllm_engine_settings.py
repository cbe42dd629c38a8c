"""The colocated vLLM engine's arguments and the CUDA allocator switch around it (no vLLM or GPU needed).

What the engine does with them on a GPU (sleep level 2, wake-up with expandable segments off, CUDA graphs, TP 2
without the custom all-reduce) is checked by the `gpu` tests (tests/gpu/) and reasoned in docs/gpu.md.
"""
from __future__ import annotations

import os

import pytest
import torch
from omegaconf import OmegaConf

from verl.trainer.config_schema import compose_config
from verl.utils.cuda_allocator import allocator_conf, expandable_segments_off, option_enabled, with_option
from verl.workers.rollout.vllm_rollout.vllm_rollout import SLEEP_LEVEL, engine_kwargs


def _rollout(**overrides):
    rollout = compose_config(["actor_rollout_ref.rollout.name=vllm"]).actor_rollout_ref.rollout
    return OmegaConf.merge(rollout, overrides)


def test_colocated_engine_disables_the_custom_all_reduce_and_sleeps_on_cuda_only():
    cuda = engine_kwargs(_rollout(tensor_model_parallel_size=2), "/m", None, "bfloat16", "cuda")
    cpu = engine_kwargs(_rollout(tensor_model_parallel_size=2), "/m", None, "float32", "cpu")
    assert cuda["disable_custom_all_reduce"] and cpu["disable_custom_all_reduce"]
    assert cuda["enable_sleep_mode"] and not cpu["enable_sleep_mode"]
    assert cuda["tensor_parallel_size"] == 2 and cuda["load_format"] == "dummy"
    assert not engine_kwargs(_rollout(free_cache_engine=False), "/m", None, "bfloat16", "cuda")["enable_sleep_mode"]
    assert SLEEP_LEVEL == 2  # weights freed, not copied to host: the next sync reloads them


def test_cuda_graphs_on_cuda_eager_elsewhere():
    assert engine_kwargs(_rollout(enforce_eager=False), "/m", None, "bfloat16", "cuda")["enforce_eager"] is False
    assert engine_kwargs(_rollout(enforce_eager=True), "/m", None, "bfloat16", "cuda")["enforce_eager"] is True
    # vLLM's CPU backend has no CUDA graphs (it would compile the model with inductor instead)
    assert engine_kwargs(_rollout(enforce_eager=False), "/m", None, "float32", "cpu")["enforce_eager"] is True


def test_allocator_options_are_flipped_one_at_a_time():
    conf = "max_split_size_mb:256, expandable_segments:True,garbage_collection_threshold:0.6"
    assert option_enabled(conf, "expandable_segments") and not option_enabled(conf, "max_split_size_mb")
    off = with_option(conf, "expandable_segments", False)
    assert off == "max_split_size_mb:256,expandable_segments:False,garbage_collection_threshold:0.6"
    assert not option_enabled(off, "expandable_segments")
    assert with_option("", "expandable_segments", False) == "expandable_segments:False"
    assert with_option("max_split_size_mb:64", "expandable_segments", True) == \
        "max_split_size_mb:64,expandable_segments:True"
    assert allocator_conf({"PYTORCH_CUDA_ALLOC_CONF": "a:1", "PYTORCH_ALLOC_CONF": ""}) == ("PYTORCH_CUDA_ALLOC_CONF",
                                                                                            "a:1")
    assert allocator_conf({}) == (None, "")


def _live() -> str | None:
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    return getter() if getter is not None else None


@pytest.mark.skipif(_live() is None, reason="this torch cannot read the allocator settings back")
def test_expandable_segments_are_off_inside_the_block_and_restored_after(monkeypatch):
    conf = "expandable_segments:True,max_split_size_mb:256"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    torch._C._accelerator_setAllocatorSettings(conf)
    try:
        with expandable_segments_off("cuda"):
            assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False,max_split_size_mb:256"
            assert _live() == "expandable_segments:False,max_split_size_mb:256"
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == conf and _live() == conf
        with expandable_segments_off("cpu"):  # off CUDA nothing changes
            assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == conf
    finally:
        torch._C._accelerator_setAllocatorSettings("expandable_segments:False")


def test_cpu_prefills_every_prompt_whole_and_cuda_keeps_chunked_prefill():
    cpu = engine_kwargs(_rollout(max_num_batched_tokens=256, max_model_len=1024), "/m", None, "float32", "cpu")
    assert cpu["enable_chunked_prefill"] is False and cpu["max_num_batched_tokens"] == 1024
    roomy = engine_kwargs(_rollout(max_num_batched_tokens=8192, max_model_len=1024), "/m", None, "float32", "cpu")
    assert roomy["max_num_batched_tokens"] == 8192
    cuda = engine_kwargs(_rollout(max_num_batched_tokens=256, max_model_len=1024), "/m", None, "bfloat16", "cuda")
    assert "enable_chunked_prefill" not in cuda and cuda["max_num_batched_tokens"] == 256
