"""Agent turns inside a multi-turn response: which loss-carrying tokens belong to which turn.

A dialogue row's `responses` interleave the policy's turns (`response_mask` 1) with user turns and padding
(`response_mask` 0). Turn-level estimators, turn-level rollout correction and per-turn reweighting all need the
same segmentation; a rollout loop that knows its turns puts it in the batch as `AGENT_TURN_IDS`, and anything
else derives it from the mask (a turn is a maximal run of consecutive loss-carrying tokens).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["AGENT_TURN_IDS", "agent_turn_ids", "agent_turn_ids_from_mask"]

AGENT_TURN_IDS = "agent_turn_ids"  # batch key: (bs, R) int64, the 0-based agent turn of each token, -1 elsewhere


def agent_turn_ids_from_mask(response_mask: torch.Tensor) -> torch.Tensor:
    """(bs, R) int64: for every position where `response_mask` is non-zero, the 0-based index of the run of
    consecutive non-zero positions it lies in (its agent turn); -1 where the mask is 0."""
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be (batch, response_length), got shape {tuple(response_mask.shape)}")
    mask = response_mask != 0
    previous = torch.nn.functional.pad(mask[:, :-1], (1, 0), value=False)
    ids = (mask & ~previous).long().cumsum(dim=1) - 1
    return torch.where(mask, ids, torch.full_like(ids, -1))


def agent_turn_ids(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The batch's `AGENT_TURN_IDS` when the rollout loop wrote them, else derived from `response_mask`.

    Turn ids written by a loop must be -1 exactly where `response_mask` is 0 (ValueError otherwise): a turn
    boundary may only move within the policy's own tokens."""
    mask = batch["response_mask"]
    if AGENT_TURN_IDS not in batch.keys():
        return agent_turn_ids_from_mask(mask)
    ids = batch[AGENT_TURN_IDS]
    if ids.shape != mask.shape:
        raise ValueError(f"{AGENT_TURN_IDS} has shape {tuple(ids.shape)}, response_mask {tuple(mask.shape)}")
    if bool(((ids >= 0) != (mask != 0)).any()):
        raise ValueError(f"{AGENT_TURN_IDS} must be >= 0 exactly where response_mask is non-zero")
    return ids.long()
