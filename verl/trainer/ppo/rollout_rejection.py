"""What rollout rejection means to the rest of a training step: one rule for every estimator and every consumer.

Rejection (``algorithm.rollout_correction.rollout_rs``, :mod:`verl.trainer.ppo.rollout_corr_helper`) judges tokens,
agent turns or whole responses by how far the training policy is from the rollout engine on them, and rejects
those out of bounds. The rule:

1. **Credit is assigned to the dialogue as sampled.** The advantage estimator (any of them, with its whitening)
   and the diagnosis reweighting read the sampled ``response_mask``, ``token_level_rewards``, ``turn_scores``,
   ``turn_labels`` and ``agent_turn_ids``: a rejected last token still delivers the dialogue's outcome reward to
   the tokens before it, a rejected turn's turn score and labels still count for its dialogue.
2. **Then the rejected tokens leave the loss.** ``response_mask`` loses them, their advantages become 0 and their
   ``agent_turn_ids`` -1 (every kept token keeps its turn's number). Rewards, turn scores, turn labels, returns,
   values and importance weights stay as they are.

So the actor and the critic train on the kept tokens only (in decoupled mode their token-mean denominators count
the kept tokens, as veRL's do after its rejection), and what they train toward is the credit of the whole sampled
dialogue. Bypass mode rejects inside the actor's loss, after the advantages, so it follows the same rule.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch

from verl.errors import ContractError
from verl.protocol import DataProto
from verl.utils.agent_turns import AGENT_TURN_IDS, agent_turn_ids

__all__ = ["apply_rejection", "credit_then_reject"]


def apply_rejection(batch: DataProto, kept: torch.Tensor) -> None:
    """Step 2 of the rule, in place: ``response_mask`` becomes ``kept`` (bs, R), a subset of it; the rejected
    tokens' ``advantages`` (when the batch has them) become 0 and their ``agent_turn_ids`` -1."""
    sampled = batch.batch["response_mask"]
    if kept.shape != sampled.shape:
        raise ContractError(f"the rejection mask has shape {tuple(kept.shape)}, response_mask {tuple(sampled.shape)}")
    keep = kept != 0
    if bool((keep & (sampled == 0)).any()):
        raise ContractError("the rejection mask keeps a token that response_mask does not hold")
    turn_ids = agent_turn_ids(batch.batch)  # the sampled numbering, before the mask changes
    batch.batch[AGENT_TURN_IDS] = torch.where(keep, turn_ids, torch.full_like(turn_ids, -1))
    batch.batch["response_mask"] = torch.where(keep, sampled, torch.zeros_like(sampled))
    if "advantages" in batch.batch.keys():
        advantages = batch.batch["advantages"]  # out of place: an estimator may return it as its returns too
        batch.batch["advantages"] = torch.where(keep, advantages, torch.zeros_like(advantages))


def credit_then_reject(batch: DataProto, kept: Optional[torch.Tensor],
                       assign_credit: Callable[[DataProto], dict[str, float]]) -> dict[str, float]:
    """The rule: ``assign_credit`` (advantages, returns, reweighting) on the batch as sampled, then
    :func:`apply_rejection` of ``kept`` (None: nothing rejected); returns ``assign_credit``'s metrics."""
    metrics = assign_credit(batch)
    if kept is not None:
        apply_rejection(batch, kept)
    return metrics
