"""The packed attention on CUDA in bf16 with Qwen2.5-7B's heads (28 query, 4 key/value heads of 128) against a
float32 per-sequence reference: outputs and gradients, whichever varlen path this torch takes (its own
``enable_gqa`` from torch 2.12, or key/value heads repeated on torch 2.11)."""
from __future__ import annotations

import math

import pytest
import torch

from verl.utils.packed_attention import packed_sdpa_attention, varlen_supports_gqa

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HEADS, KV_HEADS, HEAD_DIM = 28, 4, 128
LENGTHS = [517, 1, 1200, 64, 2331]  # one single-token sequence, lengths not multiples of any block size


def _reference(q, k, v, bounds, scale):
    """fp32 causal attention of each sequence on its own, key/value heads repeated per group (HF's repeat_kv)."""
    q, k, v = (t.float() for t in (q, k, v))
    k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    out = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        scores = q[0, :, start:end] @ k[0, :, start:end].transpose(-1, -2) * scale
        causal = torch.ones(end - start, end - start, dtype=torch.bool, device=q.device).tril()
        out.append(torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ v[0, :, start:end])
    return torch.cat(out, dim=1).transpose(0, 1).unsqueeze(0)  # (1, T, H, D)


def test_packed_attention_bf16_matches_an_fp32_reference_with_gqa():
    from torch.nn.attention.varlen import varlen_attn

    torch.manual_seed(0)
    total = sum(LENGTHS)
    bounds = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    q = torch.randn(1, HEADS, total, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, KV_HEADS, total, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    scale = 1 / math.sqrt(HEAD_DIM)
    out, _ = packed_sdpa_attention(None, q, k, v, None, scaling=scale, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                   max_length_q=max(LENGTHS), max_length_k=max(LENGTHS))
    q32, k32, v32 = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    expected = _reference(q32, k32, v32, bounds, scale)
    print(f"varlen_attn takes enable_gqa: {varlen_supports_gqa(varlen_attn)} (torch {torch.__version__})")
    assert out.shape == (1, total, HEADS, HEAD_DIM) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    grad = torch.randn_like(expected)
    out.backward(grad.to(torch.bfloat16))
    expected.backward(grad)
    for name, ours, ref in (("q", q, q32), ("k", k, k32), ("v", v, v32)):
        torch.testing.assert_close(ours.grad.float(), ref.grad, atol=5e-2, rtol=5e-2, msg=name)
