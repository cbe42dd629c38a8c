"""Every worker phase (generate, log-probs, reference, update, values, critic update) ends by returning the
device's cached memory: ``torch.cuda.empty_cache`` on CUDA, nothing on CPU."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from verl.utils import device
from verl.workers import fsdp_workers
from verl.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker

from tests.helpers.ppo_batch_helpers import RESPONSE_LEN, actor_rollout_ref_config, critic_config, make_prompts


@pytest.fixture(scope="module", autouse=True)
def single_rank_process_group():
    """The workers join a world-size-1 gloo group in this process; tear it down after the module."""
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        assert key not in os.environ, f"{key} is set in the test environment"
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_empty_cache_calls_cuda_only_with_a_gpu(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    device.empty_cache()
    assert calls == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    device.empty_cache()
    assert calls == [1]


def test_every_phase_frees_cached_memory(tiny_model_path, monkeypatch):
    phases = []
    monkeypatch.setattr(fsdp_workers, "empty_cache", lambda: phases.append(len(phases)))
    actor = ActorRolloutRefWorker(actor_rollout_ref_config(tiny_model_path), role="actor_rollout_ref")
    actor.init_model()
    critic = CriticWorker(critic_config(tiny_model_path))
    critic.init_model()
    assert phases == []
    batch = actor.generate_sequences(make_prompts(8, actor.tokenizer.vocab_size))
    assert len(phases) == 1
    batch = batch.union(actor.compute_log_prob(batch))
    assert len(phases) == 2
    batch = batch.union(actor.compute_ref_log_prob(batch))
    assert len(phases) == 3
    batch = batch.union(critic.compute_values(batch))
    assert len(phases) == 4
    batch.batch["advantages"] = torch.randn(8, RESPONSE_LEN) * batch.batch["response_mask"]
    batch.batch["returns"] = batch.batch["advantages"].clone()
    actor.update_actor(batch)
    assert len(phases) == 5
    critic.update_critic(batch)
    assert len(phases) == 6
