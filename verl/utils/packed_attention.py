"""Attention for padding-free (packed) forward passes of Hugging Face decoder models.

A packed row holds several sequences back to back: ``input_ids`` (1, T), ``position_ids`` restarting at 0 for
each sequence, and the sequence boundaries as ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (int32, (n + 1,)) with
``max_length_q`` / ``max_length_k``, the keyword arguments transformers' flash-attention path reads. Each
sequence must attend only to itself, causally.

``flash_attention_2`` / ``flash_attention_3`` handle such rows in transformers itself (``flash_attn_varlen_func``).
For ``sdpa`` and ``eager`` models this module registers the attention implementation :data:`PACKED_SDPA`:

- with ``cu_seq_lens_q`` in the call (packed rows): on CUDA in fp16/bf16, PyTorch's variable-length flash kernel
  (``torch.nn.attention.varlen.varlen_attn``, torch >= 2.11: see :func:`varlen_causal_attention` for grouped-query
  attention); elsewhere (CPU, fp32) ``scaled_dot_product_attention`` with
  ``is_causal`` on each sequence's slice, so no (T, T) mask is ever built and the work is that of the sequences;
- without it (padded batches, generation with a KV cache): transformers' own ``sdpa`` attention and masks, so
  the same model also serves the padded path and the rollout unchanged.

:func:`enable_packed_attention` switches a loaded model to it.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

logger = logging.getLogger(__name__)

PACKED_SDPA = "sead_packed_sdpa"
# Implementations that already run packed rows (transformers' varlen flash-attention path).
NATIVE_PACKED = ("flash_attention_2", "flash_attention_3", PACKED_SDPA)
_VARLEN_DTYPES = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=8)
def varlen_supports_gqa(kernel: Callable[..., torch.Tensor]) -> bool:
    """Whether ``kernel`` (PyTorch's ``varlen_attn``) takes fewer key/value heads than query heads itself: its
    ``enable_gqa`` keyword arrived in torch 2.12; torch 2.11's kernel needs as many key/value heads as query heads."""
    return "enable_gqa" in inspect.signature(kernel).parameters


def varlen_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
    scaling: float | None, kernel: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of each packed sequence with ``kernel`` (default: PyTorch's ``varlen_attn``, CUDA in
    bf16/fp16); (1, H, T, D) inputs (key/value may have fewer heads), (1, T, H, D) output.

    Grouped-query attention (fewer key/value heads) uses the kernel's ``enable_gqa`` when it has one (torch >= 2.12);
    otherwise each key/value head is repeated for its group of query heads first, as HF's ``repeat_kv`` does.
    """
    if kernel is None:
        from torch.nn.attention.varlen import varlen_attn as kernel

    q, k, v = (t.squeeze(0).transpose(0, 1) for t in (query, key, value))  # (T, H, D)
    groups = q.shape[1] // k.shape[1]
    gqa: dict[str, bool] = {}
    if groups > 1 and varlen_supports_gqa(kernel):
        gqa = {"enable_gqa": True}
    elif groups > 1:
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    out = kernel(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=scaling, window_size=(-1, 0), **gqa)
    return out.unsqueeze(0)


def _per_sequence_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int], scaling: float | None,
    dropout: float,
) -> torch.Tensor:
    """Causal SDPA on each sequence's slice of the packed row; (1, H, T, D) inputs, (1, T, H, D) output."""
    gqa = query.shape[1] != key.shape[1]
    pieces = [
        F.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
            dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa,
        )  # fmt: skip
        for start, end in zip(bounds[:-1], bounds[1:])
        if end > start
    ]
    return torch.cat(pieces, dim=2).transpose(1, 2).contiguous()


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of :data:`PACKED_SDPA`: per-sequence causal attention for packed rows, HF ``sdpa`` otherwise."""
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects one packed row, got a batch of {query.shape[0]}")
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError("packed attention does not support sliding-window layers; use flash_attention_2")
    if query.is_cuda and query.dtype in _VARLEN_DTYPES and dropout == 0.0:  # no host sync per layer
        max_len = int(kwargs.get("max_length_q") or int((cu_seqlens[1:] - cu_seqlens[:-1]).max()))
        return varlen_causal_attention(query, key, value, cu_seqlens.to(torch.int32), max_len, scaling), None
    bounds = cu_seqlens.tolist()
    if bounds[-1] != query.shape[2]:
        raise ValueError(f"cu_seq_lens_q ends at {bounds[-1]} but the packed row has {query.shape[2]} tokens")
    return _per_sequence_sdpa(query, key, value, bounds, scaling, dropout), None


def packed_sdpa_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """Mask of :data:`PACKED_SDPA`: none for a single mask-less row (the attention keeps sequences apart from
    ``cu_seq_lens_q``, or is plainly causal), HF's ``sdpa`` mask otherwise."""
    batch_size = kwargs.get("batch_size", args[0] if args else None)
    if kwargs.get("attention_mask") is None and batch_size == 1:
        q_length, kv_length = kwargs.get("q_length"), kwargs.get("kv_length")
        if q_length is not None and q_length == kv_length:
            return None
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
AttentionMaskInterface.register(PACKED_SDPA, packed_sdpa_mask)


def enable_packed_attention(model: torch.nn.Module, where: str) -> str:
    """Make ``model`` (an HF model, possibly FSDP-wrapped) accept packed rows; return its attention implementation.

    ``sdpa`` and ``eager`` models switch to :data:`PACKED_SDPA` (same results on padded batches);
    flash-attention models are left as they are. ``where`` names the config key in errors.
    """
    hf_model = getattr(model, "module", model)
    config = getattr(hf_model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current in NATIVE_PACKED:
        return current
    if current not in ("sdpa", "eager"):
        raise ValueError(f"{where}: padding-free forward needs sdpa, eager or flash_attention_2 attention, the model "
                         f"uses {current!r}")
    hf_model.set_attn_implementation(PACKED_SDPA)
    if config._attn_implementation != PACKED_SDPA:
        raise RuntimeError(f"{where}: {type(hf_model).__name__} did not switch to the packed attention "
                           f"(still {config._attn_implementation!r}); it cannot run padding-free")
    logger.info("%s: attention %s -> %s (packed rows keep sequences apart)", where, current, PACKED_SDPA)
    return PACKED_SDPA
