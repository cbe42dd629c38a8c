"""LoRA on the FSDP2 workers in this process (world size 1, gloo): only the adapter trains, the reference is the base
model, a checkpoint resumes token for token and exports the adapter (merged or alone), and the critic's adapter.

Expected values come from plain HF / PEFT models built from the files (never from the worker's own outputs)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from llm_agent.evaluation.local_agents import load_policy_model, resolve_model_dir
from verl.model_merger import merge
from verl.protocol import DataProto
from verl.utils.fsdp_utils import full_state_dict
from verl.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker

from tests.helpers.hf_reference import hf_logprobs
from tests.helpers.ppo_batch_helpers import (RESPONSE_LEN, actor_rollout_ref_config, critic_config, make_ppo_batch,
                                             make_prompts)

# peft 0.18 and transformers 5.17 (the lowest declared) run the adapter code in tests/verl/utils/test_lora.py (marked
# oldest) and the vLLM pass's tests/verl/workers/test_lora_vllm.py


@pytest.fixture(scope="module", autouse=True)
def single_rank_process_group():
    """A world-size-1 gloo group in this process (see test_fsdp_workers), torn down after the module."""
    assert "WORLD_SIZE" not in os.environ and "MASTER_ADDR" not in os.environ, "a distributed launch environment"
    with pytest.MonkeyPatch.context() as env:
        for key in ("RANK", "LOCAL_RANK", "MASTER_PORT"):
            env.delenv(key, raising=False)
        yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _lora_actor(model_path: str, role: str = "actor_rollout_ref", rank: int = 8, **actor) -> ActorRolloutRefWorker:
    cfg = actor_rollout_ref_config(model_path, **actor)
    cfg.model.lora_rank, cfg.model.lora_alpha = rank, 16
    worker = ActorRolloutRefWorker(cfg, role=role)
    worker.init_model()
    return worker


def _state(worker) -> dict[str, torch.Tensor]:
    module = worker.critic.critic_module if isinstance(worker, CriticWorker) else worker.actor.actor_module
    return {k: v.clone() for k, v in full_state_dict(module).items()}


def _update_batch(worker: ActorRolloutRefWorker, seed: int, with_ref: bool) -> DataProto:
    """Sampled responses to seeded prompts with fresh old (and ref) log-probs and seeded random advantages."""
    gen = worker.generate_sequences(make_prompts(8, worker.tokenizer.vocab_size, seed=seed))
    gen = gen.union(worker.compute_log_prob(gen))
    if with_ref:
        gen = gen.union(worker.compute_ref_log_prob(gen))
    gen.batch.pop("entropys")
    advantages = torch.randn(8, RESPONSE_LEN, generator=torch.Generator().manual_seed(seed))
    gen.batch["advantages"] = advantages * gen.batch["response_mask"]
    return gen


@pytest.mark.parametrize("param_dtype", ["auto", "bf16"])
def test_only_the_adapter_trains_and_the_reference_is_the_base(tiny_model_path, param_dtype):
    worker = _lora_actor(tiny_model_path, optim={"lr": 1e-2}, fsdp_config={"param_dtype": param_dtype})
    module = worker.actor.actor_module
    assert worker.ref_policy is None  # no second copy of the base: the reference is the actor, adapter disabled
    compute = torch.float32 if param_dtype == "auto" else torch.bfloat16
    adapter = {n: p for n, p in module.named_parameters() if ".lora_" in n}
    assert {p.dtype for n, p in module.named_parameters() if n not in adapter} == {compute}  # frozen base
    assert {p.dtype for p in adapter.values()} == {torch.float32} and len(adapter) == 2 * 2 * 7
    optimized = {id(p) for group in worker.actor.actor_optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in adapter.values()}

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    before = _state(worker)
    batch = _update_batch(worker, seed=1, with_ref=True)
    if param_dtype == "auto":
        expected = hf_logprobs(base, batch)
        torch.testing.assert_close(batch.batch["ref_log_prob"], expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batch.batch["old_log_probs"], expected, rtol=1e-5, atol=1e-5)  # B = 0 at start
    for _ in range(2):
        worker.update_actor(batch)
    after = _state(worker)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {k for k in before if ".lora_B." in k or ".lora_A." in k}
    assert all(after[k].abs().sum() > 0 for k in changed if ".lora_B." in k)

    ref_after = worker.compute_ref_log_prob(batch).batch["ref_log_prob"]
    torch.testing.assert_close(ref_after, batch.batch["ref_log_prob"], rtol=0, atol=0)
    assert not torch.allclose(worker.compute_log_prob(batch).batch["old_log_probs"], ref_after, atol=1e-3)
    if param_dtype == "auto":
        torch.testing.assert_close(ref_after, hf_logprobs(base, batch), rtol=1e-5, atol=1e-5)


def test_lora_checkpoint_resumes_token_for_token_and_exports_the_adapter(tiny_model_path, tmp_path):
    actor = {"optim": {"lr": 1e-2, "lr_warmup_steps": 3}, "use_kl_loss": False}
    first = _lora_actor(tiny_model_path, role="actor_rollout", **actor)
    first.update_actor(_update_batch(first, seed=1, with_ref=False))
    ckpt = tmp_path / "global_step_1" / "actor"
    first.save_checkpoint(str(ckpt), global_step=1)
    assert {"adapter_config.json", "adapter_model.safetensors", "config.json"} <= set(os.listdir(ckpt))
    without_export = tmp_path / "no_hf" / "actor"
    first.save_checkpoint(str(without_export), save_hf_model=False)
    probe = make_ppo_batch(8, first.tokenizer.vocab_size, seed=9)
    saved_log_probs = first.compute_log_prob(probe).batch["old_log_probs"]
    # the uninterrupted run: two more sampled rollouts and one update between them
    next_batch = _update_batch(first, seed=2, with_ref=False)
    first.update_actor(next_batch)
    later = first.generate_sequences(make_prompts(8, first.tokenizer.vocab_size, seed=3)).batch["responses"]

    resumed = _lora_actor(tiny_model_path, role="actor_rollout", **actor)
    resumed.load_checkpoint(str(ckpt))
    resumed_batch = _update_batch(resumed, seed=2, with_ref=False)
    assert torch.equal(resumed_batch.batch["responses"], next_batch.batch["responses"])  # same sampled tokens
    resumed.update_actor(resumed_batch)
    assert torch.equal(resumed.generate_sequences(make_prompts(8, resumed.tokenizer.vocab_size, seed=3))
                       .batch["responses"], later)
    after_first, after_resumed = _state(first), _state(resumed)
    assert all(torch.equal(after_first[k], after_resumed[k]) for k in after_first)

    # the HF export is the adapter: PEFT loads it on the base and gives the saved policy's log-probs
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, ckpt)
    torch.testing.assert_close(hf_logprobs(peft_model, probe), saved_log_probs, rtol=1e-5, atol=1e-5)
    merged = merge(ckpt, tmp_path / "merged", dtype="fp32")
    torch.testing.assert_close(hf_logprobs(AutoModelForCausalLM.from_pretrained(merged), probe), saved_log_probs,
                               rtol=1e-5, atol=1e-5)
    # evaluate.py's agents take the checkpoint and the adapter alone (its base merged in)
    assert resolve_model_dir(tmp_path / "global_step_1") == ckpt
    agent_model = load_policy_model(ckpt, torch.float32)
    torch.testing.assert_close(hf_logprobs(agent_model, probe), saved_log_probs, rtol=1e-5, atol=1e-5)

    # without the HF export the merger rebuilds the same adapter from the sharded state; an adapter directory alone
    # is an agent (its base from adapter_config.json)
    assert (without_export / "adapter_config.json").is_file()
    assert not (without_export / "adapter_model.safetensors").exists()
    adapter = merge(without_export, tmp_path / "adapter", adapter_only=True)
    exported, rebuilt = load_file(ckpt / "adapter_model.safetensors"), load_file(adapter / "adapter_model.safetensors")
    assert exported.keys() == rebuilt.keys() and all(torch.equal(exported[k], rebuilt[k]) for k in exported)
    assert {v.dtype for v in rebuilt.values()} == {torch.float32}
    torch.testing.assert_close(hf_logprobs(load_policy_model(adapter, torch.float32), probe), saved_log_probs,
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="holds no LoRA adapter"):
        merge(tmp_path / "merged_dir_missing", tmp_path / "x", adapter_only=True)


def test_loading_a_checkpoint_of_another_shape_is_named(tiny_model_path, tmp_path):
    lora = _lora_actor(tiny_model_path, role="actor")
    lora.save_checkpoint(str(tmp_path / "lora"))
    full_cfg = actor_rollout_ref_config(tiny_model_path)
    full = ActorRolloutRefWorker(full_cfg, role="actor")
    full.init_model()
    with pytest.raises(ValueError, match="holds a LoRA adapter, but this model is fully trained: set "
                                         "model.lora_rank"):
        full.load_checkpoint(str(tmp_path / "lora"))
    full.save_checkpoint(str(tmp_path / "full"), save_hf_model=False)
    with pytest.raises(ValueError, match="holds full weights, but this model is a LoRA model"):
        lora.load_checkpoint(str(tmp_path / "full"))
    with pytest.raises(ValueError, match="has a LoRA adapter with r=8, this model 4"):
        _lora_actor(tiny_model_path, role="actor", rank=4).load_checkpoint(str(tmp_path / "lora"))


def test_critic_lora_trains_adapter_and_head_and_exports_merged(tiny_model_path, tmp_path):
    cfg = critic_config(tiny_model_path)
    cfg.model.lora_rank, cfg.model.lora_alpha = 8, 16
    worker = CriticWorker(cfg)
    worker.init_model()
    data = make_ppo_batch(8, worker.tokenizer.vocab_size, seed=4)
    data.batch["returns"] = torch.full((8, RESPONSE_LEN), 0.5) * data.batch["response_mask"]
    before = _state(worker)
    losses = []
    for _ in range(6):
        data.batch["values"] = worker.compute_values(data).batch["values"]
        losses.append(worker.update_critic(data).meta_info["metrics"]["critic/vf_loss"][0])
    assert losses[-1] < 0.5 * losses[0]
    after = _state(worker)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".lora_" in k or "score.modules_to_save" in k for k in changed)
    assert any("score.modules_to_save" in k for k in changed)
    worker.save_checkpoint(str(tmp_path / "critic"))
    values = worker.compute_values(data).batch["values"]
    resumed = CriticWorker(cfg)
    resumed.init_model()
    resumed.load_checkpoint(str(tmp_path / "critic"))
    torch.testing.assert_close(resumed.compute_values(data).batch["values"], values, rtol=0, atol=0)
    merged = AutoModelForTokenClassification.from_pretrained(merge(tmp_path / "critic", tmp_path / "merged",
                                                                   dtype="fp32"))
    b = data.batch
    with torch.no_grad():
        logits = merged(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                        position_ids=b["position_ids"]).logits
    torch.testing.assert_close(logits[:, -RESPONSE_LEN - 1:-1, 0] * b["response_mask"], values, rtol=1e-5, atol=1e-5)
