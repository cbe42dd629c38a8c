"""FLOPs of :mod:`verl.utils.memory_model` (MFU / HFU numerators) against a hand computation, a per-query loop and
PyTorch's own FLOP counter on a real model's forward, backward and checkpointed backward."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen2Config, Qwen2ForCausalLM

from verl.utils.fsdp_utils import enable_activation_checkpointing
from verl.utils.memory_model import ModelShape, causal_attention_flops, forward_flops, pass_flops, training_flops

pytestmark = pytest.mark.oldest  # also run under the lowest declared transformers (.venv-vllm)

SMALL = {"model_type": "qwen2", "vocab_size": 2048, "hidden_size": 128, "intermediate_size": 384,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}


def test_hand_computed_small_config():
    shape = ModelShape.from_hf_config(SMALL)
    # q and o: 128 x 128 each; k and v: 128 x (2 heads x 32) each; gate, up, down: 128 x 384 each
    assert shape.layer_matmul_params == 2 * 16_384 + 2 * 8_192 + 3 * 49_152 == 196_608
    flops = pass_flops(shape, seq_lens=[10, 6], head_positions=5, checkpointing=True)
    layers_dense = 2 * 3 * 196_608 * 16  # 2 FLOPs per weight and token, 3 layers, 10 + 6 tokens
    head = 2 * 128 * 2048 * 5  # the LM head on 5 positions
    attention = 4 * 3 * 128 * (55 + 21)  # 55 = 10*11/2 and 21 = 6*7/2 query-key pairs, x 2 matmuls x 2 x q_dim
    assert flops.dense_forward == layers_dense + head == 21_495_808
    assert flops.attention_forward == attention == 116_736
    assert flops.model == 3 * (21_495_808 + 116_736) == 64_837_632
    down_projection = 2 * 3 * 128 * 384 * 16  # not recomputed: nothing saves its output
    assert flops.recompute_forward == layers_dense - down_projection + attention == 14_272_512
    assert flops.hardware == 64_837_632 + 14_272_512
    assert pass_flops(shape, [10, 6], 5, checkpointing=False).hardware == flops.model


def test_causal_attention_matches_a_per_query_loop():
    shape = ModelShape.from_hf_config(SMALL)
    for seq_lens in ([1], [7], [9728], [300, 17, 4096]):
        expected = 0
        for length in seq_lens:
            for query in range(length):  # query i attends keys 0..i
                keys = query + 1
                expected += 2 * (2 * keys * shape.head_dim) * shape.num_heads * shape.num_layers  # QK^T and PV
        assert causal_attention_flops(shape, seq_lens) == expected


def test_planner_wrappers_agree_with_pass_flops():
    shape = ModelShape.from_hf_config(SMALL)
    full = pass_flops(shape, [64] * 3, 3 * 64, checkpointing=True)
    assert training_flops(shape, 3, 64, checkpointing=True) == full.hardware
    assert training_flops(shape, 3, 64, checkpointing=False) == full.model
    assert forward_flops(shape, 3, 64, head_positions=30) == pass_flops(shape, [64] * 3, 30, False).forward
    value = pass_flops(shape, [64], 64, checkpointing=False, value_head=True)
    assert value.dense_forward == 2 * 3 * 196_608 * 64 + 2 * 128 * 1 * 64


def _counted(fn) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_formulas_match_torch_flop_counter(checkpointing):
    """Eager attention multiplies the full T x T score matrix (the mask is added after), so the counter sees
    4 x layers x q_dim x T^2 where the formula counts the causal half; everything else must agree."""
    torch.manual_seed(0)
    config = Qwen2Config(**{k: v for k, v in SMALL.items() if k != "model_type"}, attn_implementation="eager")
    model = Qwen2ForCausalLM(config).train()
    if checkpointing:
        # as build_fsdp_model does
        enable_activation_checkpointing(model)
    seq_len, keep = 24, 9
    input_ids = torch.randint(0, SMALL["vocab_size"], (1, seq_len))
    shape = ModelShape.from_hf_config(SMALL)
    formula = pass_flops(shape, [seq_len], keep, checkpointing)
    full_attention = 4 * shape.num_layers * shape.q_dim * seq_len**2
    causal_attention = formula.attention_forward
    forward = _counted(lambda: model(input_ids=input_ids, logits_to_keep=keep, use_cache=False))
    # the rotary embedding's one small matmul (head_dim/2 x positions) per forward is not a model FLOP
    assert forward == pytest.approx(formula.forward - causal_attention + full_attention, rel=1e-3)
    training = _counted(lambda: model(input_ids=input_ids, logits_to_keep=keep, use_cache=False).logits.sum()
                        .backward())
    # checkpointing re-runs each layer up to its last saved tensor: everything but the MLP's down projection
    recompute = formula.recompute_forward - causal_attention + full_attention if checkpointing else 0
    expected = 3 * (formula.forward - causal_attention + full_attention) + recompute
    assert training == pytest.approx(expected, rel=1e-3)
    assert (formula.hardware > formula.model) == checkpointing
