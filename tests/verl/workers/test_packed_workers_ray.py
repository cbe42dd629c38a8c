"""Two Ray FSDP2 workers with padding-free forwards, token-budget micro-batches, gradient checkpointing and the
offload keys (no-ops on CPU) give the log-probs and the update of one unsharded, padded, fixed-size process,
also when the ranks' rows need different numbers of micro-batches."""

from __future__ import annotations

import pytest
import ray
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.utils.optim import build_optimizer
from verl.workers.actor.dp_actor import DataParallelPPOActor
from verl.workers.fsdp_workers import ActorRolloutRefWorker

from tests.helpers.ppo_batch_helpers import actor_config, actor_rollout_ref_config, make_dialogue_batch

pytestmark = pytest.mark.processes

PROMPT, RESPONSE, ROWS = 12, 24, 8
MINI_BATCH_PROMPTS = 4  # 2 mini-batches of 2 rows per rank
BUDGET = 40  # tokens per micro-batch: rank 0's short rows fit 2 per micro-batch, rank 1's long rows 1
# AdamW's first steps move an element by about lr whatever its gradient's size: with the default eps a gradient
# within float noise of 0 whose sign differs between the sharded and the single-process sums moves a weight 2 lr
# apart (the likely cause of a failure under ATEN_CPU_CAPABILITY=default in CI). With this eps such an element moves
# by ~lr * |g| / eps, so the weights compare at 1e-5; a real difference in the gradients still shows there and in the
# grad norms.
OPTIM = {"eps": 1e-4}


def _skewed_batch():
    """Rows 0-3 (rank 0) with at most 6 response tokens, rows 4-7 (rank 1) with full-length responses."""
    data = make_dialogue_batch(ROWS, 1024, PROMPT, RESPONSE, seed=21)
    b = data.batch
    b["attention_mask"][4:, PROMPT:] = 1
    b["attention_mask"][4:, :PROMPT] = 1
    b["attention_mask"][:4, PROMPT + 6 :] = 0
    b["response_mask"][:4, 6:] = 0
    b["response_mask"][4:7, :8] = 1
    b["position_ids"] = (b["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    b["input_ids"] = torch.where(b["attention_mask"].bool(), b["input_ids"], torch.full_like(b["input_ids"], 3))
    b["responses"] = b["input_ids"][:, PROMPT:].clone()
    short, long = b["attention_mask"][:4].sum(-1), b["attention_mask"][4:].sum(-1)
    assert (short[0::2] + short[1::2] <= BUDGET).all() and (long[0::2] + long[1::2] > BUDGET).all()
    return data


@pytest.fixture(scope="module")
def packed_group(tiny_model_path):
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    config = actor_rollout_ref_config(
        tiny_model_path, ppo_mini_batch_size=MINI_BATCH_PROMPTS, ppo_micro_batch_size_per_gpu=1,
        use_dynamic_bsz=True, ppo_max_token_len_per_gpu=BUDGET,
        fsdp_config={"param_offload": True, "optimizer_offload": True},
        optim=OPTIM,
    )  # fmt: skip
    config.model.use_remove_padding = True
    config.model.enable_gradient_checkpointing = True
    config.rollout = OmegaConf.merge(config.rollout, {"log_prob_use_dynamic_bsz": True,
                                                      "log_prob_max_token_len_per_gpu": BUDGET})
    pool = RayResourcePool([2], use_gpu=False, name_prefix="packed_pool")
    group = None
    try:
        group = RayWorkerGroup(pool, RayClassWithInitArgs(ActorRolloutRefWorker, config, role="actor"),
                               name_prefix="packed_actor")
        group.init_model()
        yield group
    finally:
        if group is not None:
            group.shutdown()
        pool.remove()
        ray.shutdown()


def test_two_rank_packed_dynamic_log_probs_and_update_equal_single_padded_process(packed_group, tiny_model_path,
                                                                                   tmp_path):
    data = _skewed_batch()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    cfg = actor_config(ppo_mini_batch_size=MINI_BATCH_PROMPTS, ppo_micro_batch_size_per_gpu=2, optim=OPTIM)
    reference = DataParallelPPOActor(cfg, model, build_optimizer(model.parameters(), cfg.optim))

    got = packed_group.compute_log_prob(data).batch["old_log_probs"]
    data.meta_info["micro_batch_size"] = 3
    expected, _ = reference.compute_log_prob(data)
    scored = data.batch["attention_mask"][:, PROMPT - 1 : -1].bool() & data.batch["attention_mask"][:, PROMPT:].bool()
    torch.testing.assert_close(got[scored], expected[scored], atol=1e-5, rtol=1e-5)

    metrics = packed_group.update_actor(data).meta_info["metrics"]
    # both ranks ran 2 micro-batches per mini-batch, though rank 0's rows alone fit in one
    assert len(metrics["actor/pg_clipfrac"]) == 2 * 2 * 2
    packed_group.save_checkpoint(str(tmp_path / "actor"))
    sharded_result = AutoModelForCausalLM.from_pretrained(tmp_path / "actor", dtype=torch.float32).state_dict()
    ref_metrics = reference.update_policy(data.select_idxs([0, 1, 4, 5, 2, 3, 6, 7]))
    torch.testing.assert_close(torch.tensor(metrics["actor/grad_norm"]).view(2, 2)[0],
                               torch.tensor(ref_metrics["actor/grad_norm"]), rtol=1e-5, atol=1e-6)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(sharded_result[name], value, rtol=1e-5, atol=1e-5, msg=name)
