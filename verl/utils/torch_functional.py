"""Tensor helpers of the RL engine: masked statistics, memory-lean log-probs/entropy, masks and padding.

`log_probs_and_entropy` (and veRL's `logprobs_from_logits` / `entropy_from_logits` on top of it) never build a
second (rows, vocab) tensor for the whole batch: the logits stay in the model's compute dtype (bf16 on GPU), the
rows are cast to float32 and divided by the temperature in chunks (a few tens of MB each) in the forward pass,
only per-row statistics are kept besides the logits for the backward pass, which recomputes the softmax chunk by
chunk. Results are float32 (float64 for float64 logits) whatever the logits dtype.
"""

from __future__ import annotations

import math
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


def k3_divergence(log_ratio: torch.Tensor) -> torch.Tensor:
    """The k3 estimate exp(l) - 1 - l of each log-ratio l: >= 0 in exact arithmetic, so computed as expm1(l) - l
    and clamped at 0 (near l = 0 the rounding of exp(l) - 1 - l leaves values like -1e-9)."""
    return (torch.expm1(log_ratio) - log_ratio).clamp(min=0.0)


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


class _LogProbsAndEntropy(torch.autograd.Function):
    """log softmax(logits / T)[label] and the entropy of softmax(logits / T) per row, both from one pass over
    chunks of rows (each chunk cast to float32 and scaled there), differentiated chunk by chunk.

    Only the logits (in their own dtype), the labels and two float32 numbers per row are saved for the backward
    pass; the gradient is built in the logits' dtype, one chunk at a time, summing both outputs' gradients in
    float32 before the cast.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, temperature: float, chunk_size: int | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = _compute_dtype(logits)
        flat_labels = labels.reshape(-1)
        lse = torch.empty(flat_labels.shape[0], dtype=dtype, device=logits.device)
        expected = torch.empty_like(lse)  # E_p[z], z = logits / T
        log_probs = torch.empty_like(lse)
        for start, chunk in _row_chunks(logits, chunk_size):
            rows = slice(start, start + chunk.shape[0])
            z = chunk.to(dtype) / temperature
            lse[rows] = torch.logsumexp(z, dim=-1)
            log_probs[rows] = z.gather(-1, flat_labels[rows].unsqueeze(-1)).squeeze(-1) - lse[rows]
            probs = torch.exp(z - lse[rows].unsqueeze(-1))
            expected[rows] = torch.where(probs > 0, probs * z, 0.0).sum(-1)
        ctx.save_for_backward(logits, flat_labels, lse, expected)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.set_materialize_grads(False)
        return log_probs.view(labels.shape), (lse - expected).view(labels.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, None, None, None]:
        # with z = logits / T and p = softmax(z): d log p_y / dz = onehot(y) - p;
        # dH/dz_j = -p_j (z_j - E_p[z]) (0 where p_j = 0, i.e. logit -inf); d/dlogits = d/dz / T
        if grad_log_probs is None and grad_entropy is None:
            return None, None, None, None
        logits, flat_labels, lse, expected = ctx.saved_tensors
        temperature = ctx.temperature
        g_lp = None if grad_log_probs is None else grad_log_probs.reshape(-1).to(lse.dtype)
        g_h = None if grad_entropy is None else grad_entropy.reshape(-1).to(lse.dtype)
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad_view = grad_logits.view(-1, logits.shape[-1])
        for start, chunk in _row_chunks(logits, ctx.chunk_size):
            rows = slice(start, start + chunk.shape[0])
            z = chunk.to(lse.dtype) / temperature
            probs = torch.exp(z - lse[rows].unsqueeze(-1))
            chunk_grad = torch.zeros_like(z)
            if g_lp is not None:
                g = g_lp[rows].unsqueeze(-1)
                chunk_grad -= probs * g
                chunk_grad.scatter_add_(-1, flat_labels[rows].unsqueeze(-1), g)
            if g_h is not None:
                entropy_grad = -probs * (z - expected[rows].unsqueeze(-1)) * g_h[rows].unsqueeze(-1)
                chunk_grad += torch.where(probs > 0, entropy_grad, 0.0)
            grad_view[rows] = (chunk_grad / temperature).to(logits.dtype)
        return grad_logits, None, None, None


def log_probs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, *, chunk_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of ``labels`` (...,) and entropy under softmax(``logits`` / ``temperature``), both (...,).

    ``logits`` (..., V) stay in their dtype (bf16 from a bf16 model: no float32 copy of the whole tensor is made or
    kept for the backward pass); rows are cast to float32 ``chunk_size`` at a time (default: about 2**24 logits per
    chunk). Results are float32 (float64 for float64 logits); both are differentiable w.r.t. ``logits``.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"log-probs: logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0 to compute log-probs, got {temperature!r}")
    return _LogProbsAndEntropy.apply(logits, labels.long(), float(temperature), chunk_size)


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True, *, chunk_size: int | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probability of `labels` (...,) under softmax(`logits` / `temperature`) (..., V); differentiable w.r.t.
    logits (see :func:`log_probs_and_entropy`).

    Positional order as veRL: `(logits, labels, inplace_backward)`. `inplace_backward` is accepted for veRL
    compatibility and changes nothing: veRL uses it to let flash-attn's kernel overwrite the logits with their
    gradient; here the backward already builds the gradient chunk by chunk without a second full-vocab buffer.
    """
    if not isinstance(inplace_backward, bool):
        raise TypeError(
            "logprobs_from_logits: the 3rd positional argument is `inplace_backward` (veRL's order), got "
            f"{inplace_backward!r}; pass chunk_size as a keyword"
        )
    return log_probs_and_entropy(logits, labels, temperature, chunk_size=chunk_size)[0]


def entropy_from_logits(logits: torch.Tensor, chunk_size: int | None = None, *, temperature: float = 1.0
                        ) -> torch.Tensor:
    """Entropy of softmax(`logits` / `temperature`) over the last dim, shape logits.shape[:-1]; row-chunked and
    differentiable (see :func:`log_probs_and_entropy`); logits of -inf (p = 0) contribute 0."""
    labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return log_probs_and_entropy(logits, labels, temperature, chunk_size=chunk_size)[1]


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
