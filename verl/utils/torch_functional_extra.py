"""Smaller tensor helpers with veRL's names, re-exported by `verl.utils.torch_functional`: the sum of squared
probabilities of a softmax, a per-row value expanded over a jagged nested tensor, and statistics over all ranks
of a torch.distributed process group (works with gloo on CPU as with nccl)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from verl.errors import ContractError

__all__ = [
    "calculate_sum_pi_squared_from_logits", "distributed_masked_mean", "distributed_mean_max_min_std",
    "expand_as_nested",
]  # fmt: skip


def calculate_sum_pi_squared_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """sum_i softmax(logits)_i ** 2 over the last dim, shape logits.shape[:-1], without forming the softmax.

    Uses log sum_i p_i^2 = logsumexp(2 z) - 2 logsumexp(z), which stays finite for logits of any magnitude.
    """
    return torch.exp(torch.logsumexp(2.0 * logits, dim=-1) - 2.0 * torch.logsumexp(logits, dim=-1))


def expand_as_nested(tensor: torch.Tensor, nested_tensor: torch.Tensor) -> torch.Tensor:
    """A jagged nested tensor shaped like `nested_tensor` (bs, j) whose row i repeats `tensor[i]` (tensor: (bs,))."""
    if not (isinstance(nested_tensor, torch.Tensor) and nested_tensor.is_nested):
        raise ContractError("expand_as_nested: nested_tensor must be a nested (jagged) tensor")
    if tensor.dim() != 1:
        raise ContractError(f"expand_as_nested: tensor must be 1-D (one value per row), got shape {tuple(tensor.shape)}")
    if nested_tensor.dim() != 2:
        raise ContractError(f"expand_as_nested: nested_tensor must have 2 dims (rows, jagged), got {nested_tensor.dim()}")
    if tensor.shape[0] != nested_tensor.size(0):
        raise ContractError(
            f"expand_as_nested: tensor has {tensor.shape[0]} rows, nested_tensor has {nested_tensor.size(0)}"
        )
    offsets = nested_tensor.offsets()
    values = torch.repeat_interleave(tensor, offsets.diff(), dim=0)
    return torch.nested.nested_tensor_from_jagged(values=values, offsets=offsets)


def distributed_mean_max_min_std(
    local_tensor: torch.Tensor, compute_max: bool = True, compute_min: bool = True, compute_std: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(mean, max, min, std) of the elements of `local_tensor` over all ranks of the default process group.

    std is the unbiased (n - 1) standard deviation around the global mean; a statistic not asked for is None.
    """
    total = local_tensor.sum()
    count = torch.tensor(float(local_tensor.numel()), device=local_tensor.device, dtype=total.dtype)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    dist.all_reduce(count, op=dist.ReduceOp.SUM)
    mean = total / count
    maximum = minimum = std = None
    if compute_max:
        maximum = local_tensor.max().clone()
        dist.all_reduce(maximum, op=dist.ReduceOp.MAX)
    if compute_min:
        minimum = local_tensor.min().clone()
        dist.all_reduce(minimum, op=dist.ReduceOp.MIN)
    if compute_std:
        squares = ((local_tensor - mean) ** 2).sum()
        dist.all_reduce(squares, op=dist.ReduceOp.SUM)
        std = torch.sqrt(squares / (count - 1))
    return mean, maximum, minimum, std


def distributed_masked_mean(local_tensor: torch.Tensor, local_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the elements of `local_tensor` where `local_mask` is 1, over all ranks of the default group."""
    total = torch.where(local_mask.bool(), local_tensor, torch.zeros_like(local_tensor)).sum()
    count = local_mask.to(total.dtype).sum()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    dist.all_reduce(count, op=dist.ReduceOp.SUM)
    return total / count
