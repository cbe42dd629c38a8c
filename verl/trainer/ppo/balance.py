"""Sequence-length balancing of a batch across data-parallel ranks.

``DP_COMPUTE_PROTO`` gives rank ``r`` the ``r``-th consecutive chunk of a batch, so reordering the rows so that
every chunk holds about the same number of tokens evens out the ranks' work. The reorder is applied with
``DataProto.reorder``, which moves tensors and ``non_tensor_batch`` together: per-row data stays with its row.
"""
from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

from verl.protocol import DataProto


def balanced_partitions(lengths: Sequence[int], k_partitions: int) -> list[list[int]]:
    """Split row indices into ``k_partitions`` groups of equal size with near-equal length sums.

    Greedy longest-first: each row, longest first, goes to the lightest group that still has room. Each group's
    indices are sorted ascending (so rows keep their relative order inside a rank). ``len(lengths)`` must divide
    by ``k_partitions``.
    """
    n = len(lengths)
    if k_partitions <= 0 or n % k_partitions != 0:
        raise ValueError(f"cannot split {n} rows into {k_partitions} equal partitions")
    capacity = n // k_partitions
    order = sorted(range(n), key=lambda i: (-int(lengths[i]), i))
    heap = [(0, p) for p in range(k_partitions)]
    groups: list[list[int]] = [[] for _ in range(k_partitions)]
    for i in order:
        total, p = heapq.heappop(heap)
        groups[p].append(i)
        if len(groups[p]) < capacity:
            heapq.heappush(heap, (total + int(lengths[i]), p))
    return [sorted(g) for g in groups]


def _chunk_sums(lengths: np.ndarray, k: int) -> np.ndarray:
    return lengths.reshape(k, -1).sum(axis=1)


def balance_batch(data: DataProto, world_size: int, key: str = "attention_mask") -> dict[str, float]:
    """Reorder ``data`` in place so each DP rank's chunk has a similar token count; return balance metrics.

    The token count of a row is ``data.batch[key].sum(-1)``. Metrics: the max/min chunk token counts before and
    after (``balance/max_tokens_before`` ...). A batch that does not divide by ``world_size`` is left unchanged.
    """
    lengths = data.batch[key].sum(dim=-1).cpu().numpy()
    if world_size <= 1 or len(lengths) % world_size != 0:
        return {}
    before = _chunk_sums(lengths, world_size)
    partitions = balanced_partitions(lengths.tolist(), world_size)
    order = np.concatenate([np.asarray(p, dtype=np.int64) for p in partitions])
    data.reorder(order)
    after = _chunk_sums(lengths[order], world_size)
    return {
        "balance/max_tokens_before": float(before.max()), "balance/min_tokens_before": float(before.min()),
        "balance/max_tokens_after": float(after.max()), "balance/min_tokens_after": float(after.min()),
    }
