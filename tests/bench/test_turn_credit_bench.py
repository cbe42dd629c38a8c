"""bench/turn_credit.py at a tiny size: its batch keeps the contract (turn scores on agent tokens, one label
list per agent turn) and a run writes every option's timings."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from bench.turn_credit import dialogue_batch, main
from verl.utils.agent_turns import agent_turn_ids_from_mask


def test_batch_follows_the_turn_contract():
    batch = dialogue_batch(rows=16, length=1024, max_turns=5, group=4, seed=1)
    mask = batch.batch["response_mask"]
    assert bool((batch.batch["turn_scores"][mask == 0] == 0).all())
    turns = (agent_turn_ids_from_mask(mask).max(dim=-1).values + 1).tolist()
    assert [len(labels) for labels in batch.non_tensor_batch["turn_labels"]] == turns
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    last_agent = torch.where(mask != 0, positions, -1).max(dim=-1).values
    rewarded = batch.batch["token_level_rewards"] != 0
    assert bool(rewarded.any()) and bool((~rewarded | (positions == last_agent[:, None])).all())
    assert sorted(set(batch.non_tensor_batch["uid"])) == ["p0", "p1", "p2", "p3"]


@pytest.mark.processes  # the machine description runs lscpu/git
def test_run_writes_every_option(tmp_path, monkeypatch):
    out = tmp_path / "turn_credit.json"
    monkeypatch.setattr(sys, "argv", ["turn_credit", "--rows", "8", "--response-length", "512", "--turns", "4",
                                      "--group", "4", "--repeats", "1", "--out", str(out)])
    main()
    result = json.loads(out.read_text())
    assert set(result["median_ms"]) == {"grpo", "grpo+diagnosis", "turn_mixed", "gae", "turn_gae"}
    assert result["ratio_to_grpo"]["grpo"] == 1.0 and result["machine"]["cores"] >= 1
