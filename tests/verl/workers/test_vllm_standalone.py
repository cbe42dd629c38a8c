"""Split placement with vLLM: a rollout group of its own (one vLLM engine, no training copy of the model) given an
FSDP actor's weights by StandaloneRollout.sync (a LoRA actor's: its base once, then its adapter alone, which the
engine serves). Before the first sync it refuses to generate (its weights are
dummies); after each sync the log-probs it reports for its samples equal the actor's recomputed ones (float32
both sides, other kernels) and it reports the installed version; an engine left on the previous weights would be
far off. Needs the vLLM environment (``make vllm-env``)."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from verl.protocol import DataProto

from tests.helpers.ppo_batch_helpers import actor_rollout_ref_config, make_prompts
from tests.helpers.vllm_group import ENGINE

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.processes,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="needs vLLM: run with the vLLM environment's python (make vllm-env)")]

ROWS = 8
TOLERANCE = 1e-4  # as the hybrid engine's sync test (fp32 both sides; measured ~1e-6)


def _log_probs_under(model, batch) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits.double()
    width = batch["responses"].size(1)
    return torch.log_softmax(logits[:, -width - 1: -1], -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("lora", [False, pytest.param(True, marks=pytest.mark.extended)])  # ~60 s each measured
def test_a_standalone_vllm_rollout_generates_with_each_synced_version(tiny_model_path, lora):
    import ray

    from verl.single_controller.base.worker_group import WorkerGroupError
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.trainer.ppo.trainer_placement import StandaloneRollout
    from verl.workers.fsdp_workers import ActorRolloutRefWorker
    from verl.workers.rollout.engine import POLICY_VERSION
    from verl.workers.rollout.vllm_rollout.cpu_shm import remove_stale_segments

    config = actor_rollout_ref_config(tiny_model_path, ppo_mini_batch_size=ROWS, ppo_micro_batch_size_per_gpu=4,
                                      use_kl_loss=False, entropy_coeff=0.0, optim={"lr": 5e-2})
    config.rollout = OmegaConf.merge(config.rollout, ENGINE)
    if lora:  # the engine serves the adapter: the base arrives with the first sync, the adapter alone after
        config.model = OmegaConf.merge(config.model, {"lora_rank": 8, "lora_alpha": 16})
        config.rollout = OmegaConf.merge(config.rollout, {"max_model_len": 64, "max_num_batched_tokens": 256})
    remove_stale_segments()
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    pool = RayResourcePool([2], use_gpu=False)
    actor = standalone = None
    try:
        actor = RayWorkerGroup(pool, RayClassWithInitArgs(ActorRolloutRefWorker, config, role="actor"))
        actor.init_model()
        standalone = StandaloneRollout(config, 1, use_gpu=False)
        prompts = make_prompts(ROWS, vocab_size=1024, seed=4)
        with pytest.raises(WorkerGroupError, match="dummy weights"):
            standalone.engine.generate_sequences(prompts)
        initial = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        model_tensors = len(list(initial.parameters()))
        adapter_tensors = 2 * 7 * initial.config.num_hidden_layers if lora else 0
        gen = torch.Generator().manual_seed(0)
        for version in range(3):
            metrics = standalone.sync(actor)
            assert metrics["rollout/standalone_policy_version"] == version
            sent = adapter_tensors + (model_tensors if version == 0 or not lora else 0)
            assert metrics["rollout/weight_sync_tensors"] == sent
            out = standalone.engine.generate_sequences(prompts)
            assert out.meta_info[POLICY_VERSION] == version
            mask = out.batch["response_mask"].bool()
            trained = actor.compute_log_prob(out).batch["old_log_probs"].double()
            gap = (out.batch["rollout_log_probs"].double() - trained).abs()[mask]
            assert gap.max() < TOLERANCE, (version, gap.max())
            stale = (_log_probs_under(initial, out.batch) - trained).abs()[mask]
            assert (stale.max() < TOLERANCE) if version == 0 else (stale.mean() > 50 * TOLERANCE), stale.mean()
            advantages = torch.randn(ROWS, 1, generator=gen).sign() * out.batch["response_mask"]
            actor.update_actor(DataProto.from_dict(
                tensors={**{k: out.batch[k] for k in out.batch.keys()}, "old_log_probs": trained.float(),
                         "advantages": advantages.float()}, meta_info={"temperature": 1.0}))
    finally:
        for part in (standalone, actor):
            if part is not None:
                part.shutdown()
        pool.remove()
        ray.shutdown()
        remove_stale_segments()
