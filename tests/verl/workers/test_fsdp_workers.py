"""The FSDP workers (FSDP2 and FSDP1) in this process (world size 1, gloo): the worker API end to end, exact
checkpoint resume, HF export, and the critic."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from verl.protocol import DataProto
from verl.utils.fsdp_utils import full_state_dict
from verl.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker

from tests.helpers.hf_reference import hf_logprobs
from tests.helpers.ppo_batch_helpers import (RESPONSE_LEN, actor_rollout_ref_config, critic_config, make_ppo_batch,
                                             make_prompts)

pytestmark = pytest.mark.oldest  # also run under the lowest declared transformers (.venv-vllm)



@pytest.fixture(scope="module", autouse=True)
def single_rank_process_group():
    """The workers join a world-size-1 gloo group in this process; tear it down after the module. The worker reads
    its rank from the environment: an in-process vLLM engine of an earlier test (the `vllm` pass runs them in the
    same session) leaves RANK / LOCAL_RANK there for its launcher, so they are unset for this module."""
    assert "WORLD_SIZE" not in os.environ and "MASTER_ADDR" not in os.environ, "a distributed launch environment"
    with pytest.MonkeyPatch.context() as env:
        for key in ("RANK", "LOCAL_RANK", "MASTER_PORT"):
            env.delenv(key, raising=False)
        yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in full_state_dict(module).items()}


def _update_batch(worker: ActorRolloutRefWorker, seed: int) -> DataProto:
    """A generated batch with fresh old/ref log-probs and random advantages."""
    torch.manual_seed(seed)
    gen = worker.generate_sequences(make_prompts(8, worker.tokenizer.vocab_size, seed=seed))
    gen = gen.union(worker.compute_log_prob(gen)).union(worker.compute_ref_log_prob(gen))
    gen.batch["advantages"] = torch.randn(8, RESPONSE_LEN) * gen.batch["response_mask"]
    return gen


@pytest.mark.parametrize(
    "strategy, param_dtype", [("fsdp2", "auto"), ("fsdp", "auto"), ("fsdp2", "bf16"), ("fsdp", "bf16")]
)
def test_actor_rollout_ref_worker_api(tiny_model_path, strategy, param_dtype):
    cfg = actor_rollout_ref_config(tiny_model_path, strategy=strategy, fsdp_config={"param_dtype": param_dtype})
    worker = ActorRolloutRefWorker(cfg, role="actor_rollout_ref")
    worker.init_model()
    gen = worker.generate_sequences(make_prompts(8, worker.tokenizer.vocab_size))
    expected_keys = {"prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask"}
    assert set(gen.batch.keys()) == expected_keys
    assert gen.batch["responses"].shape == (8, RESPONSE_LEN)
    log_probs = worker.compute_log_prob(gen)
    ref = worker.compute_ref_log_prob(gen)
    assert log_probs.batch["old_log_probs"].shape == log_probs.batch["entropys"].shape == (8, RESPONSE_LEN)
    assert log_probs.batch["old_log_probs"].dtype == torch.float32
    assert "metrics" in log_probs.meta_info
    # before any update the policy is the reference
    torch.testing.assert_close(log_probs.batch["old_log_probs"], ref.batch["ref_log_prob"], rtol=0, atol=0)
    batch = gen.union(log_probs).union(ref)
    batch.batch["advantages"] = torch.randn(8, RESPONSE_LEN) * batch.batch["response_mask"]
    metrics = worker.update_actor(batch).meta_info["metrics"]
    assert metrics["actor/lr"] == [pytest.approx(1e-3)]
    assert len(metrics["actor/pg_loss"]) == 2 and metrics["actor/grad_norm_nonfinite"] == [0.0, 0.0]
    after = worker.compute_log_prob(gen).batch["old_log_probs"]
    assert not torch.allclose(after, log_probs.batch["old_log_probs"])
    # the reference stays frozen
    ref_again = worker.compute_ref_log_prob(gen).batch["ref_log_prob"]
    torch.testing.assert_close(ref_again, ref.batch["ref_log_prob"], rtol=0, atol=0)


def test_role_checks(tiny_model_path):
    with pytest.raises(ValueError, match="role"):
        ActorRolloutRefWorker(actor_rollout_ref_config(tiny_model_path), role="critic")
    with pytest.raises(ValueError, match="strategy"):
        ActorRolloutRefWorker(actor_rollout_ref_config(tiny_model_path, strategy="megatron"), role="actor")
    worker = ActorRolloutRefWorker(actor_rollout_ref_config(tiny_model_path), role="rollout")
    worker.init_model()
    with pytest.raises(RuntimeError, match="actor role"):
        worker.update_actor(make_ppo_batch(8, worker.tokenizer.vocab_size))


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp"])
def test_checkpoint_resume_is_exact_and_exports_hf(tiny_model_path, tmp_path, strategy):
    cfg = actor_rollout_ref_config(tiny_model_path, strategy=strategy, optim={"lr_warmup_steps": 3})
    first = ActorRolloutRefWorker(cfg, role="actor_rollout_ref")
    first.init_model()
    first.update_actor(_update_batch(first, seed=1))
    ckpt = tmp_path / "global_step_1" / "actor"
    first.save_checkpoint(str(ckpt), global_step=1)
    saved_params = _params(first.actor.actor_module)
    next_batch = _update_batch(first, seed=2)
    torch.manual_seed(7)
    first.load_checkpoint(str(ckpt))  # restores the RNG state of the save as well
    draw_after_load = torch.rand(5)
    metrics_first = first.update_actor(next_batch).meta_info["metrics"]
    expected = _params(first.actor.actor_module)

    # the HF export holds the weights of the save
    hf_model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    hf_state = hf_model.state_dict()
    for name, value in saved_params.items():
        assert torch.equal(hf_state[name], value), name
    assert (ckpt / "tokenizer_config.json").is_file()
    assert hf_model.config.architectures == ["Qwen2ForCausalLM"]

    resumed = ActorRolloutRefWorker(cfg, role="actor_rollout_ref")
    resumed.init_model()
    resumed.load_checkpoint(str(ckpt))
    assert torch.equal(torch.rand(5), draw_after_load)
    logits_batch = next_batch.select(batch_keys=["input_ids", "attention_mask", "position_ids", "responses"])
    torch.testing.assert_close(
        resumed.compute_log_prob(logits_batch).batch["old_log_probs"],
        hf_logprobs(hf_model, logits_batch),
        rtol=1e-5, atol=1e-5,
    )  # fmt: skip
    metrics_resumed = resumed.update_actor(next_batch).meta_info["metrics"]
    assert metrics_resumed["actor/lr"] == metrics_first["actor/lr"] == [pytest.approx(2e-3 / 3)]
    for name, value in _params(resumed.actor.actor_module).items():
        assert torch.equal(value, expected[name]), name


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp"])
def test_critic_worker_values_update_and_checkpoint(tiny_model_path, tmp_path, strategy):
    worker = CriticWorker(critic_config(tiny_model_path, strategy))
    worker.init_model()
    data = make_ppo_batch(8, worker.tokenizer.vocab_size, seed=4)
    values = worker.compute_values(data).batch["values"]
    assert values.shape == (8, RESPONSE_LEN)
    assert values[data.batch["response_mask"] == 0].eq(0).all()
    data.batch["returns"] = torch.full((8, RESPONSE_LEN), 0.5) * data.batch["response_mask"]
    losses = []
    for _ in range(6):
        data.batch["values"] = worker.compute_values(data).batch["values"]
        metrics = worker.update_critic(data).meta_info["metrics"]
        losses.append(metrics["critic/vf_loss"][0])
    assert losses[-1] < 0.5 * losses[0]
    worker.save_checkpoint(str(tmp_path / "critic"))
    exported = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic", dtype=torch.float32)
    assert exported.config.num_labels == 1
    resumed = CriticWorker(critic_config(tiny_model_path, strategy))
    resumed.init_model()
    resumed.load_checkpoint(str(tmp_path / "critic"))
    values_after = worker.compute_values(data).batch["values"]
    torch.testing.assert_close(resumed.compute_values(data).batch["values"], values_after)
