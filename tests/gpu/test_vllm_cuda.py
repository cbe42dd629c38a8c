"""The colocated vLLM engine on one CUDA GPU (needs vLLM in this environment): sleep at level 2 frees its memory
during training phases, the weights come back only through the weight sync (bucketed, in bf16), a step without an
update refreshes them before generating, and vLLM's log-probs of what it samples follow the actor after an update.
Run with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (as the trainer is) to check the allocator switch."""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

from verl.protocol import DataProto
from verl.workers.fsdp_workers import ActorRolloutRefWorker

pytestmark = [pytest.mark.gpu, pytest.mark.vllm,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install vllm)")]

ROWS, PROMPT = 8, 32


@pytest.fixture(scope="module")
def worker(gqa_model_path, actor_config_factory):
    cfg = actor_config_factory(
        gqa_model_path, "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
        "actor_rollout_ref.rollout.enforce_eager=false", "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.rollout.update_weights_bucket_megabytes=64", "actor_rollout_ref.rollout.response_length=32",
        "actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.model.enable_gradient_checkpointing=true")
    worker = ActorRolloutRefWorker(cfg, role="actor_rollout")
    worker.init_model()
    yield worker
    dist.destroy_process_group()


def _prompts(vocab: int, seed: int) -> DataProto:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (ROWS, PROMPT), generator=gen)
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                        "position_ids": torch.arange(PROMPT).expand(ROWS, -1).clone()},
                               meta_info={"response_length": 32})


def _gap(worker, out) -> float:
    """max |vLLM log-prob - actor log-prob| over the sampled tokens."""
    actor = worker.compute_log_prob(out).batch["old_log_probs"]
    mask = out.batch["response_mask"].bool()
    return float((out.batch["rollout_log_probs"] - actor).abs()[mask].max())


def test_sleep_frees_the_engine_and_the_weight_sync_brings_it_back(worker):
    out = worker.generate_sequences(_prompts(4096, 0))
    awake = torch.cuda.mem_get_info()[0]
    gap = _gap(worker, out)  # compute_log_prob puts the engine to sleep (level 2)
    assert worker.rollout.weights_discarded
    asleep = torch.cuda.mem_get_info()[0]
    assert asleep - awake > 0.2 * 0.3 * torch.cuda.get_device_properties(0).total_memory, (awake, asleep)
    assert gap < 0.1, gap  # bf16 on both sides
    # no update since the sleep: generating again must refresh the discarded weights first
    again = worker.generate_sequences(_prompts(4096, 1))
    assert not worker.rollout.weights_discarded
    assert _gap(worker, again) < 0.1


def test_after_an_update_vllm_samples_from_the_new_weights(worker):
    out = worker.generate_sequences(_prompts(4096, 2))
    out = out.union(worker.compute_log_prob(out).select(batch_keys=["old_log_probs"]))
    out.batch["advantages"] = torch.randn(ROWS, 32) * out.batch["response_mask"]
    metrics = worker.update_actor(out).meta_info["metrics"]
    assert metrics["rollout/weight_sync_gathers"][0] >= 1 and metrics["timing_s/weight_sync"][0] > 0
    assert _gap(worker, worker.generate_sequences(_prompts(4096, 3))) < 0.1
