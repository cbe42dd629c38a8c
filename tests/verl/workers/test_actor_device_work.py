"""The actor's device work: the LM head runs only on the positions that predict response tokens (same log-probs
and gradients as the full-sequence head), and the update reads metrics from the device once per mini-batch."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from verl.utils.optim import build_optimizer
from verl.workers.actor.dp_actor import DataParallelPPOActor
from verl.workers.metric_buffer import MetricBuffer

from tests.helpers.ppo_batch_helpers import RESPONSE_LEN, actor_config, make_ppo_batch


@pytest.fixture(scope="module")
def base_model(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)


def test_head_runs_on_response_positions_with_unchanged_log_probs_and_gradients(base_model):
    batch = make_ppo_batch(4, vocab_size=1024, seed=3).batch
    model = copy.deepcopy(base_model)
    head_positions = []
    model.lm_head.register_forward_hook(lambda module, args, out: head_positions.append(out.shape[1]))
    actor = DataParallelPPOActor(actor_config(), model)
    log_probs, _ = actor._forward_micro_batch(batch, temperature=0.7, calculate_entropy=False)
    assert head_positions == [RESPONSE_LEN + 1]
    (log_probs * batch["response_mask"]).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    # the full-sequence head, computed independently
    reference = copy.deepcopy(base_model)
    out = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    position_ids=batch["position_ids"], use_cache=False)
    assert out.logits.shape[1] == batch["input_ids"].shape[1]
    scaled = out.logits[:, -RESPONSE_LEN - 1: -1].float() / 0.7
    expected = torch.log_softmax(scaled, -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(log_probs, expected, rtol=1e-6, atol=1e-6)
    (expected * batch["response_mask"]).sum().backward()
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-6, msg=name)


def _host_reads_during_update(base_model, micro: int, monkeypatch) -> tuple[int, dict]:
    """Number of device-to-host reads (item / tolist / float) during one 4-row mini-batch update, and metrics."""
    reads = {"n": 0}
    for method in ("item", "tolist", "__float__"):
        original = getattr(torch.Tensor, method)

        def counted(self, *args, _original=original, **kwargs):
            reads["n"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counted)
    cfg = actor_config(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=micro)
    module = copy.deepcopy(base_model)
    actor = DataParallelPPOActor(cfg, module, build_optimizer(module.parameters(), cfg.optim))
    metrics = actor.update_policy(make_ppo_batch(4, vocab_size=1024, seed=9))
    count = reads["n"]
    monkeypatch.undo()
    return count, metrics


def test_update_reads_metrics_once_per_mini_batch(base_model, monkeypatch):
    reads_1, metrics_1 = _host_reads_during_update(base_model, 1, monkeypatch)
    reads_4, metrics_4 = _host_reads_during_update(base_model, 4, monkeypatch)
    assert reads_1 == reads_4  # 4 micro-batches cost no more host reads than 1
    assert len(metrics_1["actor/pg_clipfrac"]) == 4 and len(metrics_4["actor/pg_clipfrac"]) == 1
    for name in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        torch.testing.assert_close(torch.tensor(metrics_1[name]), torch.tensor(metrics_4[name]), rtol=1e-5, atol=1e-6)


def test_metric_buffer_keeps_order_and_mixes_numbers_and_tensors():
    buffer, metrics = MetricBuffer(), {"a": [0.5]}
    buffer.add({"a": torch.tensor(1.5), "b": 2})
    buffer.add({"a": torch.tensor([3.25]), "c": torch.tensor(4.0, dtype=torch.float64)})
    buffer.flush_into(metrics)
    assert metrics == {"a": [0.5, 1.5, 3.25], "b": [2.0], "c": [4.0]}
    buffer.flush_into(metrics)  # nothing queued any more
    assert metrics == {"a": [0.5, 1.5, 3.25], "b": [2.0], "c": [4.0]}
