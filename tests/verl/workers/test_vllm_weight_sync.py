"""The hybrid engine's weight sync on a real 2-rank Ray worker group (FSDP2 on gloo, one vLLM engine per rank).

After each of several PPO updates with a large learning rate, the log-probs vLLM reports for the tokens it
sampled must equal the FSDP actor's recomputed log-probs (``compute_log_prob``) within ``TOLERANCE``; the same
tokens under the initial weights (what an engine that was never synced would report: checked against vLLM before
the first update) must be far from them. Needs the vLLM environment (``make vllm-env``).
"""
from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM

from verl.protocol import DataProto

from tests.helpers.ppo_batch_helpers import make_prompts
from tests.helpers.vllm_group import vllm_worker_group

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="needs vLLM: run with the vLLM environment's python (make vllm-env)")]

ROWS, UPDATES = 8, 3
TOLERANCE = 1e-4  # fp32 on both sides (measured: ~1e-6); the kernels differ (vLLM CPU attention vs torch sdpa)


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def group(request, tiny_model_path):
    """A 2-rank actor_rollout group generating with vLLM, lr 5e-2 (large: every update moves the policy): two
    engines of TP 1 (two DP replicas), or one engine of TP 2 spanning both ranks."""
    actor = {"ppo_mini_batch_size": ROWS, "ppo_micro_batch_size_per_gpu": 4, "use_kl_loss": False,
             "entropy_coeff": 0.0, "optim": {"lr": 5e-2}}
    with vllm_worker_group(tiny_model_path, request.param, "vllm_sync", actor) as workers:
        yield workers


def _log_probs_under(model, batch) -> torch.Tensor:
    """Log-probs (float64) of each response token under a plain HF model at temperature 1."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits.double()
    response_len = batch["responses"].size(1)
    return torch.log_softmax(logits[:, -response_len - 1: -1], -1).gather(
        -1, batch["responses"].unsqueeze(-1)).squeeze(-1)


def test_vllm_log_probs_follow_the_actor_after_every_update(group, tiny_model_path):
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    prompts = make_prompts(ROWS, vocab_size=1024, seed=4)  # the worker adds the tokenizer's EOS and pad ids
    gen = torch.Generator().manual_seed(0)
    for update in range(UPDATES + 1):
        out = group.generate_sequences(prompts)
        mask = out.batch["response_mask"].bool()
        actor = group.compute_log_prob(out).batch["old_log_probs"].double()
        synced_gap = (out.batch["rollout_log_probs"].double() - actor).abs()[mask]
        stale_gap = (_log_probs_under(initial, out.batch) - actor).abs()[mask]
        print(f"update {update}: |vLLM - actor| max {synced_gap.max():.2e}; "
              f"|initial weights - actor| mean {stale_gap.mean():.3f} max {stale_gap.max():.3f}")
        assert synced_gap.max() < TOLERANCE, f"after {update} updates vLLM is off the actor by {synced_gap.max()}"
        if update == 0:  # the reference computation agrees with vLLM before any update ...
            assert stale_gap.max() < TOLERANCE
        else:  # ... and, once the actor has moved, an unsynced engine would be far off
            assert stale_gap.mean() > 50 * TOLERANCE, stale_gap.mean()
        if update == UPDATES:
            break
        advantages = torch.randn(ROWS, 1, generator=gen).sign() * out.batch["response_mask"]
        batch = DataProto.from_dict(tensors={**{k: out.batch[k] for k in out.batch.keys()},
                                             "old_log_probs": actor.float(), "advantages": advantages.float()},
                                    meta_info={"temperature": 1.0})
        metrics = group.update_actor(batch).meta_info["metrics"]
        assert len(metrics["timing_s/weight_sync"]) == 2 and min(metrics["timing_s/weight_sync"]) > 0
        assert min(metrics["rollout/weight_sync_tensors"]) == len(list(initial.parameters()))
        assert max(metrics["rollout/logprob_abs_diff_max"]) < TOLERANCE
