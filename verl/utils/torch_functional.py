"""Tensor helpers of the RL engine: masked statistics, memory-lean log-probs/entropy, masks and padding.

`logprobs_from_logits` and `entropy_from_logits` never build a second (rows, vocab) tensor for the whole
batch: they walk the rows in chunks (a few tens of MB each) in the forward pass, keep only per-row statistics
for the backward pass, and recompute the softmax chunk by chunk there. Results are float32 (float64 for
float64 logits) whatever the logits dtype.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from verl.utils.torch_functional_extra import (  # noqa: F401  (veRL's names, re-exported)
    calculate_sum_pi_squared_from_logits,
    distributed_masked_mean,
    distributed_mean_max_min_std,
    expand_as_nested,
)

# Elements of one (rows, vocab) chunk processed at a time: 2**24 float32 values = 64 MiB.
_CHUNK_ELEMENTS = 2**24


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Sum of `values * mask` (over `axis`, or all elements); positions where `mask` is 0 are skipped, not
    multiplied, so NaN/inf there are ignored. A non-binary mask weights the values, as in veRL."""
    valid = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    weighted = valid * mask.to(values.dtype)
    return weighted.sum() if axis is None else weighted.sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of `values` over the positions where `mask` is nonzero (0 where the mask is empty, as in veRL)."""
    count = mask.sum() if axis is None else mask.sum(dim=axis)
    return masked_sum(values, mask, axis) / (count + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `values` over the masked positions; `unbiased` applies Bessel's correction n/(n-1)."""
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count == 0:
            raise ValueError("masked_var: the mask is empty; at least one element must be 1")
        if count == 1:
            raise ValueError("masked_var: the mask has a single element; the unbiased variance divides by zero")
        variance = variance * count / (count - 1)
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Whiten with masked statistics: (values - mean) * rsqrt(var + 1e-8), adding the mean back if not `shift_mean`.

    The variance is the unbiased masked variance (veRL semantics), so the mask needs at least two elements.
    """
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def _row_blocks(logits: torch.Tensor) -> list[torch.Tensor]:
    """Split (..., V) logits into 2-D (rows, V) views covering all rows in order, without copying."""
    if logits.dim() == 2:
        return [logits]
    try:
        return [logits.view(-1, logits.shape[-1])]
    except RuntimeError:
        return [block for sub in logits.unbind(0) for block in _row_blocks(sub)]


def _row_chunks(logits: torch.Tensor, chunk_size: int | None) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (first flat row, (rows, V) view) chunks of at most `chunk_size` rows over all rows of `logits`."""
    rows = chunk_size or max(1, _CHUNK_ELEMENTS // max(1, logits.shape[-1]))
    offset = 0
    for block in _row_blocks(logits):
        for start in range(0, block.shape[0], rows):
            yield offset + start, block[start : start + rows]
        offset += block.shape[0]


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """float64 for float64 logits, float32 otherwise."""
    return torch.promote_types(logits.dtype, torch.float32)


class _LogProbs(torch.autograd.Function):
    """log softmax(logits)[label] per row, computed and differentiated chunk by chunk."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, chunk_size: int | None) -> torch.Tensor:
        dtype = _compute_dtype(logits)
        flat_labels = labels.reshape(-1)
        lse = torch.empty(flat_labels.shape[0], dtype=dtype, device=logits.device)
        out = torch.empty_like(lse)
        for start, chunk in _row_chunks(logits, chunk_size):
            rows = slice(start, start + chunk.shape[0])
            chunk = chunk.to(dtype)
            lse[rows] = torch.logsumexp(chunk, dim=-1)
            out[rows] = chunk.gather(-1, flat_labels[rows].unsqueeze(-1)).squeeze(-1) - lse[rows]
        ctx.save_for_backward(logits, flat_labels, lse)
        ctx.chunk_size = chunk_size
        return out.view(labels.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        logits, flat_labels, lse = ctx.saved_tensors
        grad_flat = grad_out.reshape(-1).to(lse.dtype)
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad_view = grad_logits.view(-1, logits.shape[-1])
        for start, chunk in _row_chunks(logits, ctx.chunk_size):
            rows = slice(start, start + chunk.shape[0])
            g = grad_flat[rows].unsqueeze(-1)
            chunk_grad = -torch.exp(chunk.to(lse.dtype) - lse[rows].unsqueeze(-1)) * g
            chunk_grad.scatter_add_(-1, flat_labels[rows].unsqueeze(-1), g)
            grad_view[rows] = chunk_grad.to(logits.dtype)
        return grad_logits, None, None


class _Entropy(torch.autograd.Function):
    """Entropy of softmax(logits) per row, computed and differentiated chunk by chunk."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, chunk_size: int | None) -> torch.Tensor:
        dtype = _compute_dtype(logits)
        n_rows = logits.numel() // max(1, logits.shape[-1])
        lse = torch.empty(n_rows, dtype=dtype, device=logits.device)
        expected = torch.empty_like(lse)
        for start, chunk in _row_chunks(logits, chunk_size):
            rows = slice(start, start + chunk.shape[0])
            chunk = chunk.to(dtype)
            lse[rows] = torch.logsumexp(chunk, dim=-1)
            probs = torch.exp(chunk - lse[rows].unsqueeze(-1))
            expected[rows] = torch.where(probs > 0, probs * chunk, 0.0).sum(-1)
        ctx.save_for_backward(logits, lse, expected)
        ctx.chunk_size = chunk_size
        return (lse - expected).view(logits.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        # dH/dz_j = -p_j * (z_j - E_p[z]); vocabulary entries with p_j = 0 (logit -inf) get gradient 0
        logits, lse, expected = ctx.saved_tensors
        grad_flat = grad_out.reshape(-1).to(lse.dtype)
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad_view = grad_logits.view(-1, logits.shape[-1])
        for start, chunk in _row_chunks(logits, ctx.chunk_size):
            rows = slice(start, start + chunk.shape[0])
            chunk = chunk.to(lse.dtype)
            probs = torch.exp(chunk - lse[rows].unsqueeze(-1))
            chunk_grad = torch.where(probs > 0, -probs * (chunk - expected[rows].unsqueeze(-1)), 0.0)
            chunk_grad = chunk_grad * grad_flat[rows].unsqueeze(-1)
            grad_view[rows] = chunk_grad.to(logits.dtype)
        return grad_logits, None


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True, *, chunk_size: int | None = None
) -> torch.Tensor:
    """Log-probability of `labels` (...,) under softmax(`logits`) (..., V); differentiable w.r.t. logits.

    Positional order as veRL: `(logits, labels, inplace_backward)`. `inplace_backward` is accepted for veRL
    compatibility and changes nothing: veRL uses it to let flash-attn's kernel overwrite the logits with their
    gradient; here the backward already builds the gradient chunk by chunk without a second full-vocab buffer.
    Rows are processed `chunk_size` (keyword-only) at a time (default: about 2**24 logits per chunk); the result
    is float32 (float64 for float64 logits).
    """
    if not isinstance(inplace_backward, bool):
        raise TypeError(
            "logprobs_from_logits: the 3rd positional argument is `inplace_backward` (veRL's order), got "
            f"{inplace_backward!r}; pass chunk_size as a keyword"
        )
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logprobs_from_logits: logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}"
        )
    return _LogProbs.apply(logits, labels.long(), chunk_size)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """Entropy of softmax(`logits`) over the last dim, shape logits.shape[:-1]; row-chunked and differentiable.

    `chunk_size` works as in `logprobs_from_logits`; logits of -inf (p = 0) contribute 0.
    """
    return _Entropy.apply(logits, chunk_size)


def get_response_mask(
    response_id: torch.Tensor, eos_token: int | Sequence[int] = 2, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """Mask (bs, R): 1 up to and including the first EOS token of each row (any of `eos_token`), 0 after it."""
    eos_ids = torch.as_tensor(eos_token, device=response_id.device).reshape(-1)
    is_eos = torch.isin(response_id, eos_ids).long()
    return ((is_eos.cumsum(dim=1) - is_eos) == 0).to(dtype)


def compute_position_id_with_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids from an attention mask: cumulative count of attended tokens minus 1, clipped at 0 (left padding)."""
    return torch.clamp(torch.cumsum(mask, dim=-1) - 1, min=0)


def pad_sequence_to_length(
    tensors: torch.Tensor, max_seq_len: int, pad_token_id: int | float, left_pad: bool = False
) -> torch.Tensor:
    """Pad the last dim of `tensors` with `pad_token_id` up to `max_seq_len` (unchanged if already that long)."""
    missing = max_seq_len - tensors.shape[-1]
    if missing <= 0:
        return tensors
    return F.pad(tensors, (missing, 0) if left_pad else (0, missing), "constant", pad_token_id)


def pad_2d_list_to_length(
    response: Sequence[Sequence[int]], pad_token_id: int, max_length: int | None = None
) -> torch.Tensor:
    """Right-pad a list of token-id lists into a tensor of width max(longest row, `max_length`)."""
    if len(response) == 0:
        raise ValueError("pad_2d_list_to_length: needs at least one row")
    width = max(len(row) for row in response)
    if max_length is not None:
        width = max(width, max_length)
    return torch.tensor([list(row) + [pad_token_id] * (width - len(row)) for row in response])
