"""The LoRA terms of the memory model against the torch profiler on CPU: one micro-batch of a LoRA model's update
(the planner's update phase) is at most the formula's peak and at least 80% of it (an upper bound: a frozen linear
layer keeps no input for its weight's gradient, which the full model's activation count includes)."""
from __future__ import annotations

import pytest
import torch

from verl.utils.fsdp_utils import enable_activation_checkpointing
from verl.utils.lora import LoraSettings, apply_lora
from verl.utils.memory_model import ModelShape, update_pass_peak
from verl.workers.actor.dp_actor import padded_log_probs

from tests.helpers.memory_profiling import measured_peak
from tests.helpers.small_qwen import SMALL, small_inputs, small_model


@pytest.mark.parametrize("dtype, checkpointing, modules", [  # each setting both ways; the GPU preset's first
    (torch.bfloat16, True, "all-linear"), (torch.bfloat16, False, ("q_proj", "v_proj")),
    (torch.float32, True, ("q_proj", "v_proj")),
])
def test_lora_update_peak_is_a_close_upper_bound(tmp_path, dtype, checkpointing, modules):
    """A rank-16 adapter computing in ``dtype`` (as FSDP's mixed precision runs it) on the small Qwen2: the profiler's
    peak of one micro-batch is at most the planner's and at least 80% of it."""
    rows, seq_len, response_len = 2, 96, 48
    model = small_model(dtype)
    if checkpointing:
        enable_activation_checkpointing(model)
    model = apply_lora(model, LoraSettings(rank=16, alpha=16, target_modules=modules), "causal_lm", "m").to(dtype)
    model.train()
    inputs = small_inputs(rows, seq_len, padded=True)

    micro = {**inputs, "responses": inputs["input_ids"][:, -response_len:]}

    def micro_batch():  # the actor's padded forward: the head on the last R + 1 positions only
        log_probs, entropy = padded_log_probs(model, micro, 1.2, calculate_entropy=True, entropy_grad=True)
        (-log_probs.mean() - 0.01 * entropy.mean()).backward()

    micro_batch()
    measured = measured_peak(micro_batch, tmp_path / "trace.json")
    shape, b = ModelShape.from_hf_config(SMALL), torch.finfo(dtype).bits // 8
    adapted = list(shape.linear_layers) if modules == "all-linear" else modules
    layers = 1 / shape.num_layers if checkpointing else 1  # one layer recomputed at a time
    expected = (update_pass_peak(shape, rows, seq_len, response_len, b, checkpointing, repeat_kv=True,
                                 head_positions=response_len + 1, entropy_grad=True).total
                + rows * seq_len * shape.lora_intermediate_bytes_per_token(16, adapted, b) * layers)
    assert 0.8 * expected <= measured <= expected
