"""A LoRA actor's vLLM rollout: a world-size-1 FSDP2 worker (gloo, in this process) whose vLLM engine serves the
base and receives the adapter in memory after every update. Greedy outputs must equal HF generate on the base model
with the checkpoint's exported adapter (PEFT), before and after training; the planner's list of vLLM's adapter ranks
must be this vLLM's. Needs the vLLM environment (``make vllm-env``).

One engine, in this process, so that the check costs one engine start: the merged-weights variant
(``model.lora.merge``) streams weights through the full-model sync that tests/verl/workers/test_vllm_weight_sync.py
covers at TP 1 and 2, and its merge is checked against PEFT's in tests/verl/utils/test_lora.py."""
from __future__ import annotations

import gc
import importlib.util
import os
import typing

import pytest
import torch
from omegaconf import OmegaConf
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from verl.trainer.plan_lora import VLLM_LORA_RANKS
from verl.workers.fsdp_workers import ActorRolloutRefWorker
from verl.workers.rollout.hf_rollout import HFRollout
from verl.workers.rollout.vllm_rollout.cpu_shm import remove_stale_segments

from tests.helpers.ppo_batch_helpers import RESPONSE_LEN, actor_rollout_ref_config, make_prompts
from tests.helpers.vllm_group import ENGINE

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="needs vLLM: run with the vLLM environment's python (make vllm-env)")]

ACTOR = {"use_kl_loss": False, "optim": {"lr": 2e-2}, "ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 4}
LORA = {"lora_rank": 8, "lora_alpha": 16}
ROWS = 8


@pytest.fixture
def lora_vllm_worker(tiny_model_path):
    """A world-size-1 actor_rollout worker with a rank-8 adapter and a vLLM engine of TP 1 in this process."""
    assert "WORLD_SIZE" not in os.environ and "MASTER_ADDR" not in os.environ, "a distributed launch environment"
    remove_stale_segments()
    cfg = actor_rollout_ref_config(tiny_model_path, **ACTOR)
    cfg.model = OmegaConf.merge(cfg.model, LORA)
    cfg.rollout = OmegaConf.merge(cfg.rollout, ENGINE, {"max_model_len": 64, "max_num_batched_tokens": 256})
    with pytest.MonkeyPatch.context() as env:
        for key in ("RANK", "LOCAL_RANK", "MASTER_PORT"):
            env.delenv(key, raising=False)
        worker = ActorRolloutRefWorker(cfg, role="actor_rollout")
        worker.init_model()
        try:
            yield worker
        finally:  # the engine's finalizer tears down vLLM's groups and the gloo group they joined
            del worker
            gc.collect()
            remove_stale_segments()


def _hf_greedy(model: torch.nn.Module, prompts) -> torch.Tensor:
    rollout = HFRollout(model, OmegaConf.create({"response_length": RESPONSE_LEN, "do_sample": False}))
    return rollout.generate_sequences(prompts).batch["responses"]


def test_vllm_with_lora_generates_as_hf_base_plus_adapter(lora_vllm_worker, tiny_model_path, tmp_path):
    from vllm.config.lora import MaxLoRARanks

    assert VLLM_LORA_RANKS == tuple(sorted(int(r) for r in typing.get_args(MaxLoRARanks)))
    worker = lora_vllm_worker
    vocab, eos, pad = len(worker.tokenizer), worker.tokenizer.eos_token_id, worker.tokenizer.pad_token_id
    greedy = make_prompts(ROWS, vocab, seed=5)
    greedy.meta_info.update({"do_sample": False, "eos_token_id": eos, "pad_token_id": pad})
    before = worker.generate_sequences(greedy).batch["responses"]
    syncs = []
    for seed in (1, 2):
        batch = worker.generate_sequences(make_prompts(ROWS, vocab, seed=seed))
        batch = batch.union(worker.compute_log_prob(batch))
        advantages = torch.randn(ROWS, RESPONSE_LEN, generator=torch.Generator().manual_seed(seed))
        batch.batch["advantages"] = advantages * batch.batch["response_mask"]
        syncs.append(worker.update_actor(batch).meta_info["metrics"])
    after = worker.generate_sequences(greedy).batch["responses"]
    worker.save_checkpoint(str(tmp_path / "actor"))

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    assert torch.equal(before, _hf_greedy(base, greedy))  # B = 0: the adapted model starts as the base
    expected = _hf_greedy(PeftModel.from_pretrained(base, tmp_path / "actor"), greedy)
    assert torch.equal(after, expected)  # the second sync replaced the first adapter, not kept it
    assert (after != before).any(dim=1).sum() >= 4  # training changed what the engine generates for most rows
    assert len(set(map(tuple, after.tolist()))) >= 4  # and not to one response everywhere
    adapter = load_file(tmp_path / "actor" / "adapter_model.safetensors")
    adapter_mb = sum(t.numel() * 4 for t in adapter.values()) / 2**20
    for metrics in syncs:  # synced after every update, the time logged; the adapter alone, in the engine's fp32
        assert len(metrics["timing_s/weight_sync"]) == 1 and metrics["timing_s/weight_sync"][0] > 0
        assert metrics["rollout/weight_sync_mb"] == [pytest.approx(adapter_mb)]
