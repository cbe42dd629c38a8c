"""vLLMRollout against HFRollout on the tiny model, in one process (a 1-rank gloo group, as in a worker).

Needs vLLM (the `.venv-vllm` environment, `make vllm-env`); skipped with that reason elsewhere. The expected
outputs come from HF `generate` and HF forward passes on a plain (unsharded) copy of the same weights.
"""
from __future__ import annotations

import importlib.util
import socket

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl.workers.rollout.hf_rollout import HFRollout

from tests.helpers.ppo_batch_helpers import PROMPT_LEN, make_prompts

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="needs vLLM: run with the vLLM environment's python (make vllm-env)")]

ROWS = 6


def _config(**overrides):
    base = {"name": "vllm", "do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "response_length": 9,
            "prompt_length": PROMPT_LEN, "micro_batch_size_per_gpu": 4, "tensor_model_parallel_size": 1,
            "gpu_memory_utilization": 0.5, "max_num_seqs": 16, "max_num_batched_tokens": 512, "max_model_len": 512,
            "enforce_eager": True, "enable_prefix_caching": True, "dtype": "float32", "seed": 0,
            "free_cache_engine": True, "calculate_log_probs": True}
    return OmegaConf.create({**base, **overrides})


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    """A vLLMRollout fed the tiny model's weights through the in-memory sync, and the plain HF model."""
    from verl.workers.rollout.vllm_rollout import WeightSyncStats, fsdp_weight_stream, vLLMRollout

    if not dist.is_initialized():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    rollout = vLLMRollout(tiny_model_path, _config(), "float32", "cpu")
    stats = WeightSyncStats()
    rollout.update_weights(fsdp_weight_stream(model, torch.float32, stats), stats)
    assert stats.tensors == len(list(model.parameters())) and stats.bytes > 0
    return rollout, model


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path, padding_side="left")


def _prompts(tokenizer, seed=11, length=None, **meta):
    """ROWS left-padded prompts of mixed lengths (up to PROMPT_LEN, or `length` tokens sharing a long prefix)."""
    data = make_prompts(ROWS, len(tokenizer), seed=seed)
    if length is not None:  # longer than vLLM's CPU KV block (128 tokens), so the prefix cache holds them
        prefix = torch.randint(4, len(tokenizer), (1, length - PROMPT_LEN), generator=torch.Generator().manual_seed(seed))
        batch = data.batch
        data.batch["input_ids"] = torch.cat([prefix.expand(ROWS, -1), batch["input_ids"]], dim=1)[:, :length]
        data.batch["attention_mask"] = torch.ones(ROWS, length, dtype=torch.long)
        data.batch["position_ids"] = torch.arange(length).expand(ROWS, -1).clone()
    data.meta_info.update({"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, **meta})
    return data


def _hf(model, prompts, **config):
    return HFRollout(model, OmegaConf.create({"response_length": 9, **config})).generate_sequences(prompts).batch


def test_greedy_equals_hf_with_mixed_lengths_eos_and_per_call_length(engine, tokenizer):
    rollout, model = engine
    plain = _hf(model, _prompts(tokenizer, do_sample=False))
    # an EOS that greedy decoding reaches early in some rows but never in others
    responses = plain["responses"]
    eos = int(responses[0, 2])
    assert any(eos not in row.tolist() for row in responses), "pick another prompt seed: every row hits the EOS"
    for response_length in (9, 4):
        prompts = _prompts(tokenizer, do_sample=False, response_length=response_length, eos_token_id=eos)
        assert prompts.batch["attention_mask"].sum(1).unique().numel() > 1, "prompts must have mixed lengths"
        expected = _hf(model, prompts)
        got = rollout.generate_sequences(prompts).batch
        assert got["responses"].shape == (ROWS, response_length)
        for key in ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask"):
            assert torch.equal(got[key], expected[key]), (response_length, key)
        stopped = got["response_mask"].sum(1) < response_length
        assert stopped.any() and not stopped.all(), "the batch must mix EOS-stopped and full-length rows"
        assert (got["responses"][~got["response_mask"].bool()] == tokenizer.pad_token_id).all()


def _actor_log_probs(model, batch, temperature):
    """log softmax(logits / T) of each response token under `model` (float64), the actor's definition."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits.double()
    response_len = batch["responses"].size(1)
    logits = logits[:, -response_len - 1: -1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)


def test_sampling_is_seeded_by_torch_rng_and_reports_the_sampled_tokens_log_probs(engine, tokenizer):
    rollout, model = engine
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(rollout.generate_sequences(_prompts(tokenizer, temperature=0.7, n=2)).batch)
    assert torch.equal(runs[0]["responses"], runs[1]["responses"])
    out = runs[0]
    assert out["responses"].shape == (2 * ROWS, 9)
    prompts = _prompts(tokenizer).batch["input_ids"]
    assert torch.equal(out["prompts"], prompts.repeat_interleave(2, dim=0))  # n responses per prompt, interleaved
    assert not torch.equal(out["responses"][0::2], out["responses"][1::2])
    mask = out["response_mask"].bool()
    expected = _actor_log_probs(model, out, temperature=0.7)
    gap = (out["rollout_log_probs"].double() - expected).abs()[mask]
    assert gap.max() < 1e-3, f"vLLM's sampled-token log-probs differ from HF's by up to {gap.max():.2e}"
    assert (out["rollout_log_probs"][~mask] == 0).all()

    # prompts longer in total than the engine's token budget (512): on CPU each is prefilled whole, since a prefill
    # split across steps would rewind its seeded generator, which a CPU generator cannot do
    torch.manual_seed(7)
    long = rollout.generate_sequences(_prompts(tokenizer, length=300, temperature=0.7)).batch
    assert long["responses"].shape == (ROWS, 9) and long["response_mask"].sum() > 0


def test_weight_update_reaches_the_engine_and_drops_stale_prefix_cache(engine, tokenizer):
    from verl.workers.rollout.vllm_rollout import WeightSyncStats, fsdp_weight_stream

    rollout, model = engine
    prompts = _prompts(tokenizer, seed=3, length=300, do_sample=False)
    before = rollout.generate_sequences(prompts).batch["responses"]  # fills the prefix cache with these prompts
    changed = AutoModelForCausalLM.from_pretrained(model.name_or_path, dtype=torch.float32)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for param in changed.parameters():
            param.add_(0.2 * torch.randn(param.shape, generator=gen))
    expected = _hf(changed, prompts)
    assert not torch.equal(expected["responses"], before), "the perturbation must change greedy outputs"
    stats = WeightSyncStats()
    rollout.update_weights(fsdp_weight_stream(changed, torch.float32, stats), stats)
    assert stats.seconds > 0
    got = rollout.generate_sequences(prompts).batch
    assert torch.equal(got["responses"], expected["responses"])
    rollout.update_weights(fsdp_weight_stream(model, torch.float32, WeightSyncStats()), WeightSyncStats())
    assert torch.equal(rollout.generate_sequences(prompts).batch["responses"], before)
