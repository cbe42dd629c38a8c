"""A LoRA actor's vLLM rollout on a real 2-rank worker group (FSDP2 on gloo): the engine serves the base with the
adapter handed over in memory after every update (one engine of TP 2), or gets the merged weights
(``model.lora.merge``, two engines of TP 1). Greedy outputs must equal HF generate on the base model with the
checkpoint's exported adapter (PEFT), before and after training. Needs the vLLM environment (``make vllm-env``)."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from omegaconf import OmegaConf
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl.workers.rollout.hf_rollout import HFRollout

from tests.helpers.ppo_batch_helpers import RESPONSE_LEN, make_prompts
from tests.helpers.vllm_group import vllm_worker_group

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="needs vLLM: run with the vLLM environment's python (make vllm-env)")]

ACTOR = {"use_kl_loss": False, "optim": {"lr": 2e-2}, "ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2}
ENGINE = {"max_model_len": 64, "max_num_batched_tokens": 256}


def _hf_greedy(model: torch.nn.Module, prompts) -> torch.Tensor:
    rollout = HFRollout(model, OmegaConf.create({"response_length": RESPONSE_LEN, "do_sample": False}))
    return rollout.generate_sequences(prompts).batch["responses"]


@pytest.mark.parametrize("tp, merge", [(2, False), (1, True)], ids=["adapter_in_memory_tp2", "merged_weights_tp1"])
def test_vllm_with_lora_generates_as_hf_base_plus_adapter(tiny_model_path, tmp_path, tp, merge):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    greedy = make_prompts(8, len(tok), seed=5)
    greedy.meta_info.update({"do_sample": False, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id})
    lora = {"lora_rank": 8, "lora_alpha": 16, "lora": {"merge": merge}}
    with vllm_worker_group(tiny_model_path, tp, f"lora_{tp}", ACTOR, ENGINE, lora) as group:
        before = group.generate_sequences(greedy).batch["responses"]
        syncs = []
        for seed in (1, 2):
            batch = group.generate_sequences(make_prompts(8, len(tok), seed=seed))
            batch = batch.union(group.compute_log_prob(batch))
            advantages = torch.randn(8, RESPONSE_LEN, generator=torch.Generator().manual_seed(seed))
            batch.batch["advantages"] = advantages * batch.batch["response_mask"]
            syncs.append(group.update_actor(batch).meta_info["metrics"])
        after = group.generate_sequences(greedy).batch["responses"]
        group.save_checkpoint(str(tmp_path / "actor"))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    model_mb = sum(p.numel() * 4 for p in base.parameters()) / 2**20
    assert torch.equal(before, _hf_greedy(base, greedy))  # B = 0: the adapted model starts as the base
    adapted = PeftModel.from_pretrained(base, tmp_path / "actor")
    expected = _hf_greedy(adapted, greedy)
    assert torch.equal(after, expected)
    assert (after != before).any(dim=1).sum() >= 4  # training changed what the engine generates for most rows
    assert len(set(after[:, 0].tolist())) >= 4  # and not to one token everywhere
    adapter_mb = sum(t.numel() * 4 for t in load_file(tmp_path / "actor" / "adapter_model.safetensors").values()) / 2**20
    for metrics in syncs:  # every rank synced after every update, the time logged
        assert len(metrics["timing_s/weight_sync"]) == 2 and min(metrics["timing_s/weight_sync"]) > 0
        # in memory, the engine's dtype (float32 on CPU): the adapter alone, or the merged model (+ the factors)
        assert metrics["rollout/weight_sync_mb"] == [pytest.approx(adapter_mb if not merge else model_mb + adapter_mb)] * 2
