"""Diagnosis-guided advantage reweighting (SEAL): scale the advantages of agent turns that carry failure labels.

A plug-in labels turns (``non_tensor_batch['turn_labels']``, see :mod:`verl.trainer.ppo.turn_layout`); the config
gives a weight per label (``algorithm.diagnosis_reweight.weights``). The engine attaches no meaning to the label
strings: a label without a weight is counted and otherwise ignored. A turn with weighted labels gets the mean
weight of its distinct weighted labels; every token of the turn has its advantage multiplied by that weight
(only where the advantage is negative / positive with ``apply_to``). Rewards and returns are never touched.
Definition and metrics: docs/turn_level_credit.md.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from verl.errors import ContractError
from verl.trainer.config_schema import DIAGNOSIS_APPLY_TO, DIAGNOSIS_WEIGHT_MAX
from verl.trainer.ppo.turn_layout import TURN_LABELS, TurnLayout
from verl.utils.agent_turns import agent_turn_ids

__all__ = ["TurnWeights", "reweight_advantages", "turn_weights"]


@dataclass
class TurnWeights:
    """The per-turn weights of a batch (``weights`` (bs, K), 1 where no weighted label) and label counts.

    ``label_turns[label]``: turns carrying a weighted label; ``labelled_turns``: turns with any label;
    ``reweighted_turns``: turns with at least one weighted label, ``weight_sum`` the sum of their weights;
    ``unweighted_labels``: (turn, label) pairs whose label has no weight (a label counts once per turn).
    """

    weights: torch.Tensor
    labelled_turns: int = 0
    reweighted_turns: int = 0
    weight_sum: float = 0.0
    unweighted_labels: int = 0
    label_turns: dict[str, int] = field(default_factory=dict)


def _row_labels(entry: Any, row: int, num_turns: int) -> Sequence[Any]:
    """The per-turn label lists of one row (an empty sequence for None); ContractError on a malformed entry."""
    if entry is None:
        return ()
    if isinstance(entry, (str, bytes)) or not isinstance(entry, (Sequence, np.ndarray)):
        raise ContractError(f"{TURN_LABELS}[{row}] must be a list with one list of label strings per agent turn, "
                            f"got {type(entry).__name__}")
    if len(entry) != num_turns:
        raise ContractError(f"{TURN_LABELS}[{row}] has {len(entry)} entries but the row has {num_turns} agent turns "
                            "(agent_turn_ids): one entry per agent turn, in order")
    return entry


def _turn_label_set(labels: Any, row: int, turn: int) -> set[str]:
    """The distinct labels of one turn; ContractError unless it is None or a sequence of strings."""
    if labels is None:
        return set()
    if isinstance(labels, (str, bytes)) or not isinstance(labels, (Sequence, np.ndarray)):
        raise ContractError(f"{TURN_LABELS}[{row}][{turn}] must be a list of label strings, got "
                            f"{type(labels).__name__}")
    out = set()
    for label in labels:
        if not isinstance(label, str):
            raise ContractError(f"{TURN_LABELS}[{row}][{turn}] holds {label!r}: labels are strings")
        out.add(label)
    return out


def turn_weights(turn_labels: Sequence[Any], layout: TurnLayout, weights: Mapping[str, float]) -> TurnWeights:
    """The weight of every agent turn of the batch from its labels (see the module docstring).

    ``turn_labels`` has one entry per row: None, or one label list per agent turn (index k = turn id k, so its
    length is one more than the row's largest turn id; a turn id without tokens is skipped).
    """
    bs, num_turns = layout.present.shape
    if len(turn_labels) != bs:
        raise ContractError(f"{TURN_LABELS} has {len(turn_labels)} rows, the batch {bs}")
    row_turns = layout.turn_counts().tolist()
    table = torch.ones(bs, num_turns, dtype=torch.float64, device=layout.present.device)
    present = layout.present.tolist()
    result = TurnWeights(weights=table)
    for row, entry in enumerate(turn_labels):
        for turn, labels in enumerate(_row_labels(entry, row, row_turns[row])):
            found = _turn_label_set(labels, row, turn)
            if not found or not present[row][turn]:
                continue
            weighted = sorted(label for label in found if label in weights)
            result.labelled_turns += 1
            result.unweighted_labels += len(found) - len(weighted)
            if weighted:
                weight = math.fsum(weights[label] for label in weighted) / len(weighted)
                result.reweighted_turns += 1
                result.weight_sum += weight
                table[row, turn] = weight
                for label in weighted:
                    result.label_turns[label] = result.label_turns.get(label, 0) + 1
    return result


def reweight_advantages(data: Any, weights: Mapping[str, float], apply_to: str) -> dict[str, float]:
    """Multiply ``data.batch['advantages']`` by the weight of each token's agent turn, in place; the metrics.

    ``data`` is a DataProto with ``advantages`` and ``response_mask`` (and optionally ``agent_turn_ids``) in its
    batch and ``turn_labels`` in its ``non_tensor_batch``. ``apply_to``: ``all`` scales every labelled turn's
    advantages, ``negative`` / ``positive`` only the tokens whose advantage has that sign. Metrics (logged as
    they are): ``diagnosis/labelled_turns``, ``diagnosis/reweighted_turns``, ``diagnosis/mean_weight`` (over the
    reweighted turns; 1 if none), ``diagnosis/unweighted_labels`` (labels without a weight, once per turn),
    ``diagnosis/reweighted_token_frac`` (agent tokens whose advantage was scaled by a weight other than 1),
    ``diagnosis/adv_abs_ratio`` (sum of |advantage| over agent tokens after / before; 1 if it was 0) and
    ``diagnosis/turns/<label>`` for every weighted label.
    """
    if apply_to not in DIAGNOSIS_APPLY_TO:
        raise ValueError(f"apply_to must be one of {list(DIAGNOSIS_APPLY_TO)}, got {apply_to!r}")
    for label, weight in weights.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                or not 0 <= weight <= DIAGNOSIS_WEIGHT_MAX:
            raise ValueError(f"the weight of label {label!r} must be a number in [0, {DIAGNOSIS_WEIGHT_MAX:g}], "
                             f"got {weight!r}")
    if TURN_LABELS not in data.non_tensor_batch:
        raise ContractError(f"diagnosis reweighting needs non_tensor_batch['{TURN_LABELS}'] (per-turn labels from the "
                            "reward or rollout-loop plug-in; docs/turn_level_credit.md)")
    advantages = data.batch["advantages"]
    mask = data.batch["response_mask"] != 0
    layout = TurnLayout.from_turn_ids(agent_turn_ids(data.batch))
    found = turn_weights(data.non_tensor_batch[TURN_LABELS], layout, weights)
    token_weights = (layout.to_tokens(found.weights - 1.0) + 1.0).to(advantages.dtype)
    if apply_to == "negative":
        token_weights = torch.where(advantages < 0, token_weights, torch.ones_like(token_weights))
    elif apply_to == "positive":
        token_weights = torch.where(advantages > 0, token_weights, torch.ones_like(token_weights))
    before = float(advantages[mask].abs().sum())
    scaled = advantages * token_weights
    data.batch["advantages"] = scaled
    after = float(scaled[mask].abs().sum())
    metrics = {
        "diagnosis/labelled_turns": float(found.labelled_turns),
        "diagnosis/reweighted_turns": float(found.reweighted_turns),
        "diagnosis/mean_weight": found.weight_sum / found.reweighted_turns if found.reweighted_turns else 1.0,
        "diagnosis/unweighted_labels": float(found.unweighted_labels),
        "diagnosis/reweighted_token_frac": float((mask & (token_weights != 1.0)).sum()) / max(int(mask.sum()), 1),
        "diagnosis/adv_abs_ratio": after / before if before > 0 else 1.0,
    }
    metrics.update({f"diagnosis/turns/{label}": float(found.label_turns.get(label, 0)) for label in weights})
    return metrics
