"""The units a rollout-correction ratio is taken over: single tokens, agent turns, or whole sequences.

A (bs, R) response is cut into units: every loss-carrying token (``response_mask`` non-zero) belongs to exactly
one unit of its row, every other position to none. Per-unit sums, means and maxima are (bs, K) tensors, K the
most units any row has; :meth:`Units.spread` puts a per-unit value back on the unit's tokens. Positions outside
the mask are never read (their values may be anything, NaN included).
"""
from __future__ import annotations

from typing import Optional

import torch

from verl.utils.agent_turns import agent_turn_ids_from_mask

__all__ = ["Units"]


class Units:
    """Tokens of a (bs, R) response grouped into units: ``ids`` is (bs, R), the 0-based unit of each token in its
    row, -1 outside the mask; ``count`` the number of unit slots per row (K)."""

    def __init__(self, ids: torch.Tensor, count: int):
        self.ids = ids.long()
        self.count = max(int(count), 1)
        self._slot = self.ids + 1  # slot 0 collects the positions outside every unit and is dropped
        ones = torch.ones_like(self.ids, dtype=torch.float64)
        self.sizes = self._scatter_sum(ones)  # (bs, K) tokens per unit, float64
        self.valid = self.sizes > 0  # (bs, K) units that exist

    @classmethod
    def for_level(cls, level: str, response_mask: torch.Tensor, turn_ids: Optional[torch.Tensor] = None) -> "Units":
        """Units of ``level`` (token | turn | sequence) over ``response_mask``; ``turn_ids`` (bs, R), >= 0 on every
        mask token (ignored elsewhere), segments turns (default: maximal runs of consecutive mask tokens)."""
        if response_mask.dim() != 2:
            raise ValueError(f"response_mask must be (batch, response_length), got {tuple(response_mask.shape)}")
        inside = response_mask != 0
        minus_one = torch.full(response_mask.shape, -1, dtype=torch.long, device=response_mask.device)
        if level == "token":
            positions = torch.arange(response_mask.size(1), device=response_mask.device).expand_as(minus_one)
            return cls(torch.where(inside, positions, minus_one), response_mask.size(1))
        if level == "sequence":
            return cls(torch.where(inside, torch.zeros_like(minus_one), minus_one), 1)
        if level != "turn":
            raise ValueError(f"unit level must be token, turn or sequence, got {level!r}")
        if turn_ids is None:
            turn_ids = agent_turn_ids_from_mask(response_mask)
        elif turn_ids.shape != response_mask.shape:
            raise ValueError(f"turn_ids has shape {tuple(turn_ids.shape)}, response_mask {tuple(response_mask.shape)}")
        elif bool((inside & (turn_ids < 0)).any()):
            raise ValueError("turn_ids must be >= 0 wherever response_mask is non-zero (every loss token is in a turn)")
        turn_ids = torch.where(inside, turn_ids.long(), minus_one)  # positions outside the mask belong to no turn
        count = int(turn_ids.max()) + 1 if turn_ids.numel() else 1
        return cls(turn_ids, count)

    def _scatter_sum(self, values: torch.Tensor) -> torch.Tensor:
        out = values.new_zeros(values.size(0), self.count + 1)
        clean = torch.where(self.ids >= 0, values, torch.zeros((), dtype=values.dtype, device=values.device))
        return out.scatter_add_(1, self._slot, clean)[:, 1:]

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """(bs, K) sum of ``values`` over each unit's tokens (0 for missing units)."""
        return self._scatter_sum(values)

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """(bs, K) mean of ``values`` over each unit's tokens (0 for missing units)."""
        return self.sum(values) / self.sizes.clamp(min=1).to(values.dtype)

    def max(self, values: torch.Tensor) -> torch.Tensor:
        """(bs, K) maximum of ``values`` over each unit's tokens (0 for missing units)."""
        out = values.new_full((values.size(0), self.count + 1), float("-inf"))
        out = out.scatter_reduce(1, self._slot, values, reduce="amax", include_self=True)[:, 1:]
        return torch.where(self.valid, out, torch.zeros_like(out))

    def spread(self, unit_values: torch.Tensor) -> torch.Tensor:
        """(bs, R): each token gets the value of its unit, positions outside every unit 0."""
        padded = torch.cat([unit_values.new_zeros(unit_values.size(0), 1), unit_values], dim=1)
        return padded.gather(1, self._slot)
