"""Diagnosis-guided reweighting against an independent float64 loop over dialogues and turns, on random
labelled batches; the check is shown to fail on wrong variants (trajectory-level scaling, labels one turn off,
weights spilling into user spans); rewards and returns are never touched; malformed labels fail clearly."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from verl.errors import ContractError
from verl.protocol import DataProto
from verl.trainer.ppo.diagnosis_reweight import reweight_advantages
from verl.utils.agent_turns import AGENT_TURN_IDS

LENGTH = 30
WEIGHTS = {"doubt_unanswered": 1.5, "false_claim": 2.0, "premature_push": 0.0, "truncated": 0.5}
POOL = [*WEIGHTS, "format_error", "loop_timeout"]  # the last two have no weight


def runs(mask_row: list[int]) -> list[list[int]]:
    """The positions of each maximal run of 1s (the agent turns), in order."""
    turns: list[list[int]] = []
    for t, m in enumerate(mask_row):
        if m and (t == 0 or not mask_row[t - 1]):
            turns.append([])
        if m:
            turns[-1].append(t)
    return turns


def random_mask_row(rng: random.Random) -> list[int]:
    """Agent turns (1) and user turns (0) alternating from an agent turn, right padding."""
    row: list[int] = []
    agent = True
    while len(row) < LENGTH - 4 and rng.random() < 0.85:
        row += [int(agent)] * rng.randint(1, 4)
        agent = not agent
    return (row + [0] * LENGTH)[:LENGTH]


def random_labelled_batch(rng: random.Random, bs: int = 12):
    """Masks (row 0 without agent tokens), advantages (non-zero also off the turns, as whitened GAE leaves
    them), and per-turn labels: None for some rows, empty or random label sets (duplicates included)."""
    mask = [[0] * LENGTH] + [random_mask_row(rng) for _ in range(bs - 1)]
    advantages = [[rng.gauss(0.0, 1.0) for _ in range(LENGTH)] for _ in range(bs)]
    labels = []
    for row in mask:
        if rng.random() < 0.2:
            labels.append(None)
            continue
        labels.append([[rng.choice(POOL) for _ in range(rng.choice([0, 0, 1, 1, 2, 3]))] for _ in runs(row)])
    return mask, advantages, labels


def object_column(values: list) -> np.ndarray:
    """A 1-D object array holding one Python object per row."""
    column = np.empty(len(values), dtype=object)
    column[:] = values
    return column


def make_batch(mask, advantages, labels, turn_ids=None) -> DataProto:
    """A DataProto with the reweighting's inputs plus rewards and returns (which must stay unchanged)."""
    shape = (len(mask), len(mask[0]))
    tensors = {"advantages": torch.tensor(advantages, dtype=torch.float64), "response_mask": torch.tensor(mask),
               "token_level_rewards": torch.randn(shape), "returns": torch.randn(shape)}
    if turn_ids is not None:
        tensors[AGENT_TURN_IDS] = turn_ids
    return DataProto.from_dict(tensors=tensors, non_tensors={"turn_labels": object_column(labels)})


def turn_weight(labels: list[str]) -> float | None:
    """The mean weight of the distinct weighted labels, None if there is none."""
    weighted = [WEIGHTS[label] for label in set(labels) if label in WEIGHTS]
    return math.fsum(weighted) / len(weighted) if weighted else None


def ref_reweight(advantages, mask, labels, apply_to="all", turns=None, shift=0, spill=False):
    """Each token of a labelled turn times the turn's weight (sign-filtered by apply_to). Wrong variants:
    ``shift`` applies turn k's labels to turn k+shift, ``spill`` also scales the user tokens after the turn."""
    turns = turns or [runs(row) for row in mask]
    out = [list(row) for row in advantages]
    for i, row_labels in enumerate(labels):
        for k, turn_labels in enumerate(row_labels or []):
            weight = turn_weight(turn_labels)
            if weight is None or not 0 <= k + shift < len(turns[i]):
                continue
            positions = list(turns[i][k + shift])
            if spill:
                t = positions[-1] + 1
                while t < LENGTH and not mask[i][t]:
                    positions.append(t)
                    t += 1
            for t in positions:
                a = advantages[i][t]
                if apply_to == "all" or (apply_to == "negative" and a < 0) or (apply_to == "positive" and a > 0):
                    out[i][t] = a * weight
    return out


def ref_trajectory_level(advantages, labels):
    """Wrong variant (SEAL's per-trajectory A-Patch): every token of a row times the mean weight of its labels."""
    out = [list(row) for row in advantages]
    for i, row_labels in enumerate(labels):
        found = [label for turn in row_labels or [] for label in turn if label in WEIGHTS]
        if found:
            weight = math.fsum(WEIGHTS[label] for label in found) / len(found)
            out[i] = [a * weight for a in out[i]]
    return out


def assert_close(actual: torch.Tensor, expected: list[list[float]]) -> None:
    """Equal to the float64 reference."""
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)


@pytest.fixture(params=[0, 1, 2, 3])
def rng(request) -> random.Random:
    """A seeded generator; each test runs on four random batches."""
    return random.Random(3100 + request.param)


@pytest.mark.parametrize("apply_to", ["all", "negative", "positive"])
def test_reweighting_matches_float64_reference(rng, apply_to):
    mask, advantages, labels = random_labelled_batch(rng)
    data = make_batch(mask, advantages, labels)
    rewards, returns = data.batch["token_level_rewards"].clone(), data.batch["returns"].clone()
    metrics = reweight_advantages(data, WEIGHTS, apply_to)
    assert_close(data.batch["advantages"], ref_reweight(advantages, mask, labels, apply_to))
    assert torch.equal(data.batch["token_level_rewards"], rewards) and torch.equal(data.batch["returns"], returns)

    turn_sets = [set(turn) for row in labels for turn in row or []]
    weights = [turn_weight(list(s)) for s in turn_sets if s]
    weights = [w for w in weights if w is not None]
    assert metrics["diagnosis/labelled_turns"] == sum(1 for s in turn_sets if s)
    assert metrics["diagnosis/reweighted_turns"] == len(weights)
    assert metrics["diagnosis/mean_weight"] == pytest.approx(math.fsum(weights) / len(weights))
    assert metrics["diagnosis/unweighted_labels"] == sum(1 for s in turn_sets for label in s if label not in WEIGHTS)
    for label in WEIGHTS:
        assert metrics[f"diagnosis/turns/{label}"] == sum(1 for s in turn_sets if label in s)
    agent = torch.tensor(mask) != 0
    before = torch.tensor(advantages, dtype=torch.float64)[agent].abs().sum()
    assert metrics["diagnosis/adv_abs_ratio"] == pytest.approx(float(data.batch["advantages"][agent].abs().sum()
                                                                     / before))
    expected = ref_reweight(advantages, mask, labels, apply_to)  # random advantages: a weight other than 1 changes them
    changed = sum(1 for i, row in enumerate(mask) for t, m in enumerate(row)
                  if m and expected[i][t] != advantages[i][t])
    assert metrics["diagnosis/reweighted_token_frac"] == pytest.approx(changed / int(agent.sum()))


def test_reweighting_check_fails_on_wrong_variants(rng):
    mask, advantages, labels = random_labelled_batch(rng)
    data = make_batch(mask, advantages, labels)
    reweight_advantages(data, WEIGHTS, "all")
    right = data.batch["advantages"]
    expected = ref_reweight(advantages, mask, labels)
    assert_close(right, expected)
    for wrong in (ref_trajectory_level(advantages, labels),  # the whole dialogue scaled
                  ref_reweight(advantages, mask, labels, shift=1),  # labels one turn late
                  ref_reweight(advantages, mask, labels, spill=True)):  # the user turn after a labelled turn too
        with pytest.raises(AssertionError):
            assert_close(torch.tensor(wrong, dtype=torch.float64), expected)


def test_reweighting_uses_the_loops_turn_ids(rng):
    mask, advantages, _ = random_labelled_batch(rng)
    turns = []
    for row in mask:  # the loop split every multi-token run in two turns
        turns.append([part for turn in runs(row) for part in ([turn[:1], turn[1:]] if len(turn) > 1 else [turn])])
    labels = [[[rng.choice(POOL)] for _ in row] for row in turns]
    ids = torch.full((len(mask), LENGTH), -1, dtype=torch.long)
    for i, row in enumerate(turns):
        for k, turn in enumerate(row):
            ids[i, turn] = k
    data = make_batch(mask, advantages, labels, turn_ids=ids)
    reweight_advantages(data, WEIGHTS, "all")
    assert_close(data.batch["advantages"], ref_reweight(advantages, mask, labels, turns=turns))


def test_reweighting_by_hand():
    mask = [[1, 1, 0, 1, 0, 1, 0]]
    advantages = [[-1.0, -2.0, 5.0, 3.0, 7.0, -4.0, 9.0]]
    labels = [[["false_claim", "false_claim"], [], ["truncated", "doubt_unanswered", "format_error"]]]
    data = make_batch(mask, advantages, labels)
    metrics = reweight_advantages(data, WEIGHTS, "all")
    assert data.batch["advantages"][0].tolist() == [-2.0, -4.0, 5.0, 3.0, 7.0, -4.0, 9.0]
    assert metrics["diagnosis/reweighted_turns"] == 2 and metrics["diagnosis/mean_weight"] == 1.5
    # the last turn's weighted labels average to 1 (0.5 and 1.5): counted as reweighted, its tokens unchanged
    assert metrics["diagnosis/unweighted_labels"] == 1 and metrics["diagnosis/reweighted_token_frac"] == 0.5


def test_malformed_labels_and_weights_fail_clearly():
    mask, advantages = [[1, 0, 1]], [[1.0, 0.0, -1.0]]
    with pytest.raises(ContractError, match="turn_labels"):
        batch = make_batch(mask, advantages, [None])
        batch.non_tensor_batch.pop("turn_labels")
        reweight_advantages(batch, WEIGHTS, "all")
    for labels, match in (([[["false_claim"]]], "1 entries but the row has 2 agent turns"),
                          (["false_claim"], "must be a list with one list of label strings per agent turn"),
                          ([["false_claim", []]], r"turn_labels\[0\]\[0\] must be a list of label strings"),
                          ([[[3], []]], "labels are strings")):
        with pytest.raises(ContractError, match=match):
            reweight_advantages(make_batch(mask, advantages, labels), WEIGHTS, "all")
    for bad in (math.nan, math.inf, -0.1, 2.5, True):
        with pytest.raises(ValueError, match="false_claim"):
            reweight_advantages(make_batch(mask, advantages, [None]), {"false_claim": bad}, "all")
    with pytest.raises(ValueError, match="apply_to"):
        reweight_advantages(make_batch(mask, advantages, [None]), WEIGHTS, "sometimes")
