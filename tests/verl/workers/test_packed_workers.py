"""The FSDP workers (FSDP2 and FSDP1, world size 1, gloo) with padding-free forwards, token-budget micro-batches,
gradient checkpointing and the offload keys give the padded, fixed-size workers' results."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from verl.utils.fsdp_utils import full_state_dict
from verl.utils.packed_attention import PACKED_SDPA
from verl.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker

from tests.helpers.ppo_batch_helpers import actor_rollout_ref_config, critic_config, make_dialogue_batch, make_prompts

pytestmark = pytest.mark.oldest  # also run under the lowest declared transformers (.venv-vllm)


PROMPT, RESPONSE, ROWS = 12, 24, 8


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


def _actor_worker(model_path: str, strategy: str, packed: bool) -> ActorRolloutRefWorker:
    cfg = actor_rollout_ref_config(
        model_path, strategy=strategy, ppo_mini_batch_size=ROWS, ppo_micro_batch_size_per_gpu=2,
        use_kl_loss=True, use_dynamic_bsz=packed, ppo_max_token_len_per_gpu=70,
        fsdp_config={"param_offload": packed, "optimizer_offload": packed},
        optim={"lr": 0.1, "eps": 1.0, "weight_decay": 0.0},  # first AdamW step ~ lr * gradient (|g| << eps)
    )  # fmt: skip
    cfg.model.use_remove_padding = packed
    cfg.model.enable_gradient_checkpointing = packed
    cfg.rollout = OmegaConf.merge(cfg.rollout, {"response_length": RESPONSE, "log_prob_use_dynamic_bsz": packed,
                                                "log_prob_max_token_len_per_gpu": 50})
    cfg.ref = OmegaConf.merge(cfg.ref, {"log_prob_use_dynamic_bsz": packed, "log_prob_max_token_len_per_gpu": 45,
                                        "fsdp_config": {"param_offload": packed}})
    worker = ActorRolloutRefWorker(cfg, role="actor_rollout_ref")
    worker.init_model()
    return worker


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp"])
def test_packed_dynamic_actor_worker_matches_padded_worker(tiny_model_path, strategy):
    padded, packed = (_actor_worker(tiny_model_path, strategy, flag) for flag in (False, True))
    module = packed.actor.actor_module
    assert getattr(module, "module", module).config._attn_implementation == PACKED_SDPA
    data = make_dialogue_batch(ROWS, 1024, PROMPT, RESPONSE, seed=31)
    mask = data.batch["attention_mask"].bool()
    scored = mask[:, PROMPT - 1 : -1] & mask[:, PROMPT:]
    for method, key in (("compute_log_prob", "old_log_probs"), ("compute_log_prob", "entropys"),
                        ("compute_ref_log_prob", "ref_log_prob")):
        expected = getattr(padded, method)(data).batch[key]
        got = getattr(packed, method)(data).batch[key]
        torch.testing.assert_close(got[scored], expected[scored], atol=1e-5, rtol=1e-5, msg=f"{method} {key}")
    initial = {k: v.clone() for k, v in full_state_dict(padded.actor.actor_module).items()}
    expected_metrics = padded.update_actor(data).meta_info["metrics"]
    metrics = packed.update_actor(data).meta_info["metrics"]
    assert len(metrics["actor/pg_clipfrac"]) != len(expected_metrics["actor/pg_clipfrac"])
    for name in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert metrics[name][0] == pytest.approx(expected_metrics[name][0], rel=1e-5), name
    expected_params = full_state_dict(padded.actor.actor_module)
    for name, value in full_state_dict(packed.actor.actor_module).items():
        torch.testing.assert_close(value, expected_params[name], atol=1e-7, rtol=0.0, msg=name)
    assert max((expected_params[k] - initial[k]).abs().max() for k in initial) > 1e-4  # a real step
    # the rollout still generates on the packed-attention model exactly as on the plain one
    prompts = make_prompts(4, 1024, seed=3)
    prompts.meta_info["do_sample"] = False
    assert torch.equal(packed.generate_sequences(prompts).batch["responses"],
                       padded.generate_sequences(prompts).batch["responses"])


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp"])
def test_packed_dynamic_critic_worker_matches_padded_worker(tiny_model_path, strategy):
    workers = []
    for packed in (False, True):
        cfg = critic_config(tiny_model_path, strategy)
        cfg.model.use_remove_padding = packed
        cfg.model.fsdp_config = {"param_offload": packed, "optimizer_offload": packed}
        cfg.ppo_mini_batch_size = ROWS
        cfg.use_dynamic_bsz, cfg.ppo_max_token_len_per_gpu, cfg.forward_max_token_len_per_gpu = packed, 70, 40
        cfg.optim = OmegaConf.merge(cfg.optim, {"lr": 0.01, "eps": 1.0})  # a step ~ lr * gradient
        worker = CriticWorker(cfg)
        worker.init_model()
        workers.append(worker)
    data = make_dialogue_batch(ROWS, 1024, PROMPT, RESPONSE, seed=32)
    values = [w.compute_values(data).batch["values"] for w in workers]
    torch.testing.assert_close(values[1], values[0], atol=1e-5, rtol=1e-5)
    initial = {k: v.clone() for k, v in full_state_dict(workers[0].critic.critic_module).items()}
    metrics = [w.update_critic(data).meta_info["metrics"] for w in workers]
    assert metrics[1]["critic/vf_loss"][0] == pytest.approx(metrics[0]["critic/vf_loss"][0], rel=1e-5)
    expected_params = full_state_dict(workers[0].critic.critic_module)
    for name, value in full_state_dict(workers[1].critic.critic_module).items():
        torch.testing.assert_close(value, expected_params[name], atol=1e-7, rtol=0.0, msg=name)
    assert max((expected_params[k] - initial[k]).abs().max() for k in initial) > 1e-4  # a real step
