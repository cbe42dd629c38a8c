"""Each feature-detected path against the API of the oldest supported versions, on CPU.

torch 2.11 (the GPU machine's; its wheel here would pull gigabytes of CUDA packages) is tested through its exact
``varlen_attn`` signature: a stand-in with that signature (and this torch's, for the other path) computes causal
attention per sequence in float64, so the packed attention's call must bind to it and give the reference's
values and gradients. transformers' checkpointing switch is tested for real in both environments: .venv holds the
newest transformers (``activation_checkpointing_enable``), .venv-vllm the lowest declared one, 5.17
(``gradient_checkpointing_enable`` only); the `oldest` marker runs this module in both.
"""
from __future__ import annotations

import inspect
import math

import pytest
import torch
import transformers
from torch.nn.attention.varlen import varlen_attn

from verl.utils.fsdp_utils import enable_activation_checkpointing
from verl.utils.packed_attention import varlen_causal_attention, varlen_supports_gqa

pytestmark = pytest.mark.oldest

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 16
BOUNDS = [0, 5, 6, 19, 30]


def _causal_per_sequence(query, key, value, cu_seq_q, scale):
    """Float64 causal attention of each sequence; (T, H, D) inputs with as many key/value heads as query heads."""
    out = []
    for start, end in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist()):
        q, k, v = (t[start:end].transpose(0, 1).double() for t in (query, key, value))
        scores = q @ k.transpose(-1, -2) * scale
        mask = torch.ones(end - start, end - start, dtype=torch.bool).tril()
        out.append((torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v).transpose(0, 1))
    return torch.cat(out).to(query.dtype)


def varlen_attn_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                     window_size=(-1, -1)):
    """torch 2.11's varlen_attn signature (no enable_gqa): causal only, as many key/value heads as query heads."""
    assert window_size == (-1, 0), "the packed attention asks for causal attention"
    assert query.shape[1] == key.shape[1] == value.shape[1], "torch 2.11's kernel has no grouped-query attention"
    return _causal_per_sequence(query, key, value, cu_seq_q, scale)


def _newer_kernel():
    """A stand-in with this torch's varlen_attn signature (enable_gqa and all), grouping heads itself."""
    def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kwargs):
        assert kwargs["enable_gqa"] is True and key.shape[1] == KV_HEADS, "GQA must be handed to the kernel"
        key, value = (t.repeat_interleave(query.shape[1] // key.shape[1], dim=1) for t in (key, value))
        return _causal_per_sequence(query, key, value, cu_seq_q, kwargs["scale"])

    kernel.__signature__ = inspect.signature(varlen_attn)
    return kernel


def test_feature_detection_reads_the_signature():
    assert not varlen_supports_gqa(varlen_attn_2_11)
    assert varlen_supports_gqa(_newer_kernel()) == ("enable_gqa" in inspect.signature(varlen_attn).parameters)


@pytest.mark.parametrize("kernel", [varlen_attn_2_11, _newer_kernel()], ids=["torch-2.11", "this-torch"])
def test_grouped_query_attention_on_either_signature_matches_a_per_head_reference(kernel):
    torch.manual_seed(0)
    total, scale = BOUNDS[-1], 1 / math.sqrt(HEAD_DIM)
    q = torch.randn(1, HEADS, total, HEAD_DIM, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, KV_HEADS, total, HEAD_DIM, dtype=torch.float64, requires_grad=True) for _ in range(2))
    cu = torch.tensor(BOUNDS, dtype=torch.int32)
    out = varlen_causal_attention(q, k, v, cu, max(b - a for a, b in zip(BOUNDS, BOUNDS[1:])), scale, kernel=kernel)
    # reference: every query head against its group's key/value head, one sequence and one head at a time
    expected = torch.empty(1, total, HEADS, HEAD_DIM, dtype=torch.float64)
    for head in range(HEADS):
        kv = head // (HEADS // KV_HEADS)
        for start, end in zip(BOUNDS[:-1], BOUNDS[1:]):
            scores = q[0, head, start:end] @ k[0, kv, start:end].T * scale
            scores = scores.masked_fill(~torch.ones(end - start, end - start, dtype=torch.bool).tril(), float("-inf"))
            expected[0, start:end, head] = torch.softmax(scores, -1) @ v[0, kv, start:end]
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(expected)
    ours = torch.autograd.grad(out, (q, k, v), grad)
    theirs = torch.autograd.grad(expected, (q, k, v), grad)
    for name, a, b in zip("qkv", ours, theirs):
        torch.testing.assert_close(a, b, msg=name)


def _layers(model):
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def test_checkpointing_switch_of_this_transformers_recomputes_every_layer(tiny_model_path):
    """Whichever switch this transformers has, every decoder layer is recomputed in the backward pass and the
    gradients equal those without checkpointing."""
    from transformers import AutoModelForCausalLM

    newest_api = hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable")
    print(f"transformers {transformers.__version__}: "
          f"{'activation' if newest_api else 'gradient'}_checkpointing_enable")
    ids = torch.randint(4, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    grads, calls = [], []
    for checkpointing in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float64).train()
        if checkpointing:
            enable_activation_checkpointing(model)
        count = [0]
        for layer in _layers(model):  # the attention inside each layer runs again when the layer is recomputed
            layer.self_attn.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
        model(input_ids=ids, use_cache=False).logits.square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        calls.append(count[0])
    layers = len(_layers(model))
    assert calls == [layers, 2 * layers]  # each layer's forward runs again in the backward pass
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=name)
