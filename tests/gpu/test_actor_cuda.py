"""The actor on one CUDA GPU (FSDP2 on NCCL, bf16 compute, fp32 master weights), world size 1 in this process:
log-probs of packed rows against padded rows, one update with gradient checkpointing and packing against the
same update padded and without checkpointing, and a checkpoint save / load round trip."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from verl.utils.fsdp_utils import full_state_dict
from verl.workers.fsdp_workers import ActorRolloutRefWorker

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROWS = 8


@pytest.fixture(scope="module")
def workers(gqa_model_path, actor_config_factory):
    """Two actors of the same weights: packed rows + token budgets + checkpointing, and padded rows."""
    packed = ActorRolloutRefWorker(actor_config_factory(
        gqa_model_path, "actor_rollout_ref.model.use_remove_padding=true",
        "actor_rollout_ref.model.enable_gradient_checkpointing=true", "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=600"), role="actor")
    padded = ActorRolloutRefWorker(actor_config_factory(gqa_model_path), role="actor")
    for worker in (packed, padded):
        worker.init_model()
    assert dist.get_backend() == "nccl"
    yield packed, padded
    dist.destroy_process_group()


def _state(worker) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in full_state_dict(worker._module).items()}


def test_packed_log_probs_equal_padded_ones(workers, dialogue_batch_factory):
    packed, padded = workers
    batch = dialogue_batch_factory(ROWS, 4096)
    ours, theirs = (w.compute_log_prob(batch).batch for w in (packed, padded))
    mask = batch.batch["response_mask"].bool()
    # bf16 kernels differ (varlen flash vs padded SDPA); log-probs of a 4096-token vocab agree to ~1e-2
    torch.testing.assert_close(ours["old_log_probs"][mask], theirs["old_log_probs"][mask], atol=5e-2, rtol=0)
    torch.testing.assert_close(ours["entropys"][mask], theirs["entropys"][mask], atol=5e-2, rtol=0)


def test_one_update_with_checkpointing_and_packing_matches_the_padded_update(workers, dialogue_batch_factory):
    packed, padded = workers
    batch = dialogue_batch_factory(ROWS, 4096, seed=1)
    batch = batch.union(padded.compute_log_prob(batch).select(batch_keys=["old_log_probs"]))
    before = _state(padded)
    metrics = [w.update_actor(batch).meta_info["metrics"] for w in (packed, padded)]
    for name in ("actor/pg_loss", "actor/grad_norm"):
        ours, theirs = sum(metrics[0][name]), sum(metrics[1][name])
        assert torch.isfinite(torch.tensor(ours)) and ours == pytest.approx(theirs, rel=5e-2, abs=1e-3), name
    after_packed, after_padded = _state(packed), _state(padded)
    for name, old in before.items():
        step_packed, step_padded = after_packed[name] - old, after_padded[name] - old
        assert step_padded.abs().max() > 0, name
        cosine = torch.nn.functional.cosine_similarity(step_packed.flatten(), step_padded.flatten(), dim=0)
        assert cosine > 0.99, (name, float(cosine))


def test_checkpoint_round_trip_on_cuda(workers, tmp_path):
    packed, _ = workers
    packed.save_checkpoint(str(tmp_path / "ckpt"))
    saved = _state(packed)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32)
    for name, tensor in exported.state_dict().items():  # the HF export holds the weights in the compute dtype
        torch.testing.assert_close(tensor, saved[name].to(torch.bfloat16).float(), atol=0, rtol=0, msg=name)
    with torch.no_grad():
        for param in packed._module.parameters():
            param.add_(1.0)
    packed.load_checkpoint(str(tmp_path / "ckpt"))
    restored = _state(packed)
    for name, tensor in saved.items():
        assert torch.equal(restored[name], tensor), name
    assert next(packed._module.parameters()).device.type == "cuda"
