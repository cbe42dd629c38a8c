"""The per-turn view of a multi-turn batch, and the batch keys through which plug-ins hand per-turn signals to
the trainer.

A dialogue row's response interleaves the policy's agent turns (``response_mask`` 1) with user turns and
padding (0); :mod:`verl.utils.agent_turns` numbers the agent turns of every token (``agent_turn_ids``, -1
off-turn). :class:`TurnLayout` turns that numbering into (batch, turns) views: which turns a row has, where each
starts, per-turn sums of a token tensor, and per-turn values broadcast back to the turn's tokens.

Batch keys a reward or rollout-loop plug-in may write (the engine reads them, docs/turn_level_credit.md):

- ``TURN_SCORES`` = ``"turn_scores"``: (bs, R) float, the per-turn process reward. Agent turn k's reward is the sum
  of the row's ``turn_scores`` over the tokens of turn k (put it on the turn's last token, as the outcome reward
  sits on the row's last agent token); non-zero off the agent turns is a contract error (checked against the
  sampled mask: after rollout rejection a rejected turn keeps its score, see rollout_rejection.py). It is separate from
  ``token_level_scores`` (the trajectory reward) and read only by the turn-level estimators.
- ``TURN_LABELS`` = ``"turn_labels"`` (in ``non_tensor_batch``): per row, one entry per agent turn (turn id k at
  index k), each a list of label strings (empty: no label), or None for a row without labels; read by the
  diagnosis reweighting (:mod:`verl.trainer.ppo.diagnosis_reweight`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from verl.errors import ContractError

__all__ = ["TURN_LABELS", "TURN_SCORES", "TurnLayout", "check_turn_ids", "check_turn_scores"]

TURN_SCORES = "turn_scores"
TURN_LABELS = "turn_labels"


def check_turn_ids(turn_ids: torch.Tensor, response_mask: torch.Tensor) -> None:
    """ContractError unless ``turn_ids`` has the mask's (batch, response_length) shape and is >= 0 exactly where
    ``response_mask`` is non-zero (a token outside the agent turns belongs to no turn)."""
    if turn_ids.dim() != 2 or turn_ids.shape != response_mask.shape:
        raise ContractError(f"agent_turn_ids has shape {tuple(turn_ids.shape)}, response_mask "
                            f"{tuple(response_mask.shape)}: both must be (batch, response_length)")
    if bool(((turn_ids >= 0) != (response_mask != 0)).any()):
        raise ContractError("agent_turn_ids must be >= 0 exactly where response_mask is non-zero")


def check_turn_scores(turn_scores: torch.Tensor, response_mask: torch.Tensor) -> None:
    """ContractError unless ``turn_scores`` is a finite (batch, response_length) tensor that is 0 wherever
    ``response_mask`` is 0 (a per-turn reward off the agent turns would be silently lost)."""
    if turn_scores.shape != response_mask.shape:
        raise ContractError(f"{TURN_SCORES} has shape {tuple(turn_scores.shape)}, response_mask "
                            f"{tuple(response_mask.shape)}")
    if not bool(torch.isfinite(turn_scores).all()):
        raise ContractError(f"{TURN_SCORES} holds NaN or inf")
    outside = (response_mask == 0) & (turn_scores != 0)
    if bool(outside.any()):
        row, pos = (int(i) for i in outside.nonzero()[0])
        raise ContractError(f"{TURN_SCORES} is non-zero off the agent turns (row {row}, position {pos}, where "
                            "response_mask is 0): put each turn's reward on one of its own tokens")


@dataclass(frozen=True)
class TurnLayout:
    """Where the agent turns of each row lie.

    ``turn_ids`` (bs, R) int64 is the agent turn of every token (-1 off-turn); ``num_turns`` K is one more than
    the largest id in the batch; ``present`` (bs, K) says whether row i has tokens of turn k and
    ``first_token`` (bs, K) the position of its first token (0 where absent). A row's turns are its present ids
    in increasing order; an id with no tokens (a gap) is skipped like a user turn.
    """

    turn_ids: torch.Tensor
    present: torch.Tensor
    first_token: torch.Tensor

    @classmethod
    def from_turn_ids(cls, turn_ids: torch.Tensor) -> "TurnLayout":
        """The layout of a (bs, R) agent-turn numbering (-1 off-turn, 0-based turn ids elsewhere)."""
        if turn_ids.dim() != 2:
            raise ContractError(f"agent_turn_ids must be (batch, response_length), got {tuple(turn_ids.shape)}")
        turn_ids = turn_ids.long()
        if bool((turn_ids < -1).any()):
            raise ContractError("agent_turn_ids must be -1 (off-turn) or a 0-based turn number")
        bs, length = turn_ids.shape
        num_turns = int(turn_ids.max()) + 1 if turn_ids.numel() else 0
        on_turn = turn_ids >= 0
        positions = torch.arange(length, device=turn_ids.device).expand(bs, length)
        first = torch.full((bs, num_turns), length, dtype=torch.long, device=turn_ids.device)
        if num_turns:
            first.scatter_reduce_(1, turn_ids.clamp(min=0), torch.where(on_turn, positions, length),
                                  reduce="amin", include_self=True)
        present = first < length
        return cls(turn_ids=turn_ids, present=present, first_token=torch.where(present, first, 0))

    @property
    def num_turns(self) -> int:
        """K: one more than the largest agent-turn id in the batch (0 without agent tokens)."""
        return self.present.shape[1]

    def turn_counts(self) -> torch.Tensor:
        """(bs,) int64: one more than each row's largest agent-turn id (0 for a row without agent tokens)."""
        bs, num_turns = self.present.shape
        if num_turns == 0:
            return torch.zeros(bs, dtype=torch.long, device=self.present.device)
        ids = torch.arange(1, num_turns + 1, device=self.present.device).expand(bs, num_turns)
        return torch.where(self.present, ids, 0).amax(dim=1)

    def sum_per_turn(self, token_values: torch.Tensor) -> torch.Tensor:
        """(bs, K): the sum of ``token_values`` (bs, R) over the tokens of each turn (0 for an absent turn)."""
        bs, num_turns = self.present.shape
        sums = torch.zeros(bs, num_turns, dtype=token_values.dtype, device=token_values.device)
        if num_turns == 0:
            return sums
        on_turn = self.turn_ids >= 0
        return sums.scatter_add_(1, self.turn_ids.clamp(min=0),
                                 torch.where(on_turn, token_values, torch.zeros_like(token_values)))

    def at_first_token(self, token_values: torch.Tensor) -> torch.Tensor:
        """(bs, K): ``token_values`` (bs, R) at each turn's first token (0 for an absent turn)."""
        picked = token_values.gather(1, self.first_token)
        return torch.where(self.present, picked, torch.zeros_like(picked))

    def to_tokens(self, turn_values: torch.Tensor) -> torch.Tensor:
        """(bs, R): every token of turn k gets ``turn_values[:, k]`` (bs, K); tokens off the agent turns get 0."""
        if turn_values.shape != self.present.shape:
            raise ContractError(f"per-turn values have shape {tuple(turn_values.shape)}, the layout "
                                f"{tuple(self.present.shape)}")
        if self.num_turns == 0:
            return torch.zeros(self.turn_ids.shape, dtype=turn_values.dtype, device=turn_values.device)
        spread = turn_values.gather(1, self.turn_ids.clamp(min=0))
        return torch.where(self.turn_ids >= 0, spread, torch.zeros_like(spread))
