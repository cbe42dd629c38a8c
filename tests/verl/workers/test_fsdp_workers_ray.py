"""Two Ray workers running FSDP2 / FSDP1 on gloo generate and update exactly like one unsharded process."""

from __future__ import annotations

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.utils.optim import build_optimizer
from verl.workers.actor.dp_actor import DataParallelPPOActor
from verl.workers.fsdp_workers import ActorRolloutRefWorker
from verl.workers.rollout.hf_rollout import HFRollout

from tests.helpers.ppo_batch_helpers import (RESPONSE_LEN, actor_config, actor_rollout_ref_config, make_ppo_batch,
                                             make_prompts)

pytestmark = pytest.mark.processes

ROWS = 8
MINI_BATCH_PROMPTS = 4  # global rows per optimizer step (rollout.n = 1): 2 mini-batches, 2 rows per rank each


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray instance for the module (8 logical CPUs: only a scheduling resource)."""
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module", params=["fsdp2", "fsdp"])
def actor_group(request, ray_cluster, tiny_model_path):
    """A 2-rank ActorRolloutRefWorker group (role actor_rollout, FSDP2 or FSDP1) on a 2-slot CPU pool."""
    strategy = request.param
    pool = RayResourcePool([2], use_gpu=False, name_prefix=f"h4_{strategy}_pool")
    config = actor_rollout_ref_config(
        tiny_model_path, strategy=strategy, ppo_mini_batch_size=MINI_BATCH_PROMPTS, ppo_micro_batch_size_per_gpu=1
    )
    actor_cls = RayClassWithInitArgs(ActorRolloutRefWorker, config, role="actor_rollout")
    try:
        group = RayWorkerGroup(pool, actor_cls, name_prefix=f"h4_{strategy}_actor")
        try:
            group.init_model()
            yield group
        finally:
            group.shutdown()
    finally:
        pool.remove()


def test_two_rank_greedy_generation_equals_single_process(actor_group, tiny_model_path):
    """Greedy decoding on the sharded model (synced_gpus across ranks) matches plain HF generate."""
    prompts = make_prompts(ROWS, vocab_size=1024, seed=6)
    prompts.meta_info["do_sample"] = False
    generated = actor_group.generate_sequences(prompts)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    prompts.meta_info.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    expected = HFRollout(model, actor_rollout_ref_config(tiny_model_path).rollout).generate_sequences(prompts)
    assert generated.batch["responses"].shape == (ROWS, RESPONSE_LEN)
    for key in ("responses", "response_mask", "input_ids", "attention_mask", "position_ids"):
        assert torch.equal(generated.batch[key], expected.batch[key]), key


def test_two_rank_fsdp_update_equals_single_process_update(actor_group, tiny_model_path, tmp_path):
    data = make_ppo_batch(ROWS, vocab_size=1024, seed=5)
    metrics = actor_group.update_actor(data).meta_info["metrics"]
    actor_group.save_checkpoint(str(tmp_path / "actor"))
    sharded_result = AutoModelForCausalLM.from_pretrained(tmp_path / "actor", dtype=torch.float32).state_dict()

    # Reference: one process, the whole model. Rank r holds rows [4r, 4r+4); its k-th mini-batch is rows
    # 4r+2k, 4r+2k+1, so the global k-th mini-batch is {2k, 2k+1, 4+2k, 5+2k}.
    order = [0, 1, 4, 5, 2, 3, 6, 7]
    reference_data = data.select_idxs(order)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    cfg = actor_config(ppo_mini_batch_size=MINI_BATCH_PROMPTS, ppo_micro_batch_size_per_gpu=2)
    reference = DataParallelPPOActor(cfg, model, build_optimizer(model.parameters(), cfg.optim))
    ref_metrics = reference.update_policy(reference_data)

    # the trainer receives rank 0's per-mini-batch values, then rank 1's; their mean over ranks is the loss
    for name in ("actor/pg_loss", "actor/kl_loss", "actor/entropy"):
        per_rank = torch.tensor(metrics[name]).view(2, 2)
        torch.testing.assert_close(per_rank.mean(0), torch.tensor(ref_metrics[name]), rtol=1e-5, atol=1e-6)
    grad_norms = torch.tensor(metrics["actor/grad_norm"]).view(2, 2)  # the same on both ranks
    torch.testing.assert_close(grad_norms[0], torch.tensor(ref_metrics["actor/grad_norm"]))
    torch.testing.assert_close(grad_norms[1], grad_norms[0])
    for name, value in model.state_dict().items():
        torch.testing.assert_close(sharded_result[name], value, rtol=1e-5, atol=1e-5, msg=name)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).state_dict()
    assert any(not torch.equal(initial[name], value) for name, value in sharded_result.items())


def test_two_rank_checkpoint_resume_is_exact(actor_group, tmp_path):
    """save -> update -> load -> the same update again gives bitwise the same weights (sharded optimizer state)."""
    data = make_ppo_batch(ROWS, vocab_size=1024, seed=8)
    actor_group.save_checkpoint(str(tmp_path / "saved"))
    actor_group.update_actor(data)
    actor_group.save_checkpoint(str(tmp_path / "uninterrupted"))
    actor_group.load_checkpoint(str(tmp_path / "saved"))
    actor_group.update_actor(data)
    actor_group.save_checkpoint(str(tmp_path / "resumed"))
    saved, uninterrupted, resumed = (
        AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.float32).state_dict()
        for name in ("saved", "uninterrupted", "resumed")
    )
    assert any(not torch.equal(saved[name], uninterrupted[name]) for name in saved)
    for name, value in uninterrupted.items():
        assert torch.equal(resumed[name], value), name


def test_two_rank_update_gives_dispatch_padding_rows_no_loss(actor_group, tmp_path):
    """3 rows over 2 ranks: DP_COMPUTE_PROTO pads with a copy of row 0, which must not count twice. The update
    equals the one on 4 rows whose 4th row carries no loss tokens (rank 1 holds rows 2 and 3 in both)."""
    data = make_ppo_batch(3, vocab_size=1024, seed=9)
    no_loss_row = data.select_idxs([0, 1, 2, 0])
    no_loss_row.batch["response_mask"][3] = 0
    actor_group.save_checkpoint(str(tmp_path / "start"))
    padded_metrics = actor_group.update_actor(data).meta_info["metrics"]
    actor_group.save_checkpoint(str(tmp_path / "padded"))
    actor_group.load_checkpoint(str(tmp_path / "start"))
    masked_metrics = actor_group.update_actor(no_loss_row).meta_info["metrics"]
    actor_group.save_checkpoint(str(tmp_path / "masked"))
    padded, masked, start = (
        AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.float32).state_dict()
        for name in ("padded", "masked", "start")
    )
    assert any(not torch.equal(start[name], padded[name]) for name in start)
    for name, value in masked.items():
        torch.testing.assert_close(padded[name], value, rtol=1e-6, atol=1e-7, msg=name)
    for name in ("actor/pg_loss", "actor/grad_norm"):
        torch.testing.assert_close(torch.tensor(padded_metrics[name]), torch.tensor(masked_metrics[name]))
