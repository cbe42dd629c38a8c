"""Tests of verl.utils.agent_turns against a plain-Python scan of the mask."""
import pytest
import torch

from verl.utils.agent_turns import AGENT_TURN_IDS, agent_turn_ids, agent_turn_ids_from_mask


def _scan(row: list[int]) -> list[int]:
    out, turn, inside = [], -1, False
    for m in row:
        if m and not inside:
            turn += 1
        inside = bool(m)
        out.append(turn if m else -1)
    return out


def test_turn_ids_match_a_python_scan_on_random_masks():
    gen = torch.Generator().manual_seed(0)
    mask = (torch.rand(64, 37, generator=gen) < 0.6).long()
    mask[3] = 0  # a row with no agent token
    mask[5] = 1  # a row that is one turn
    expected = torch.tensor([_scan(r) for r in mask.tolist()])
    assert torch.equal(agent_turn_ids_from_mask(mask), expected)


def test_hand_written_dialogue_row():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 1, 1, 1, 0, 0]])
    assert agent_turn_ids_from_mask(mask).tolist() == [[0, 0, -1, -1, 1, -1, 2, 2, 2, -1, -1]]


def test_loop_written_ids_are_used_and_checked():
    mask = torch.tensor([[1, 1, 0, 1]])
    written = torch.tensor([[0, 1, -1, 2]])  # adjacent turns the mask alone cannot separate
    assert agent_turn_ids({"response_mask": mask, AGENT_TURN_IDS: written}).tolist() == [[0, 1, -1, 2]]
    assert agent_turn_ids({"response_mask": mask}).tolist() == [[0, 0, -1, 1]]
    with pytest.raises(ValueError, match="exactly where"):
        agent_turn_ids({"response_mask": mask, AGENT_TURN_IDS: torch.tensor([[0, 0, 0, 1]])})
