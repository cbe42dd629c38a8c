"""The dialogue reward's per-turn side: per-turn components against an independent float64 computation from the
records, `turn_scores` on each agent turn's last token (from the mask's runs or a loop's `agent_turn_ids`),
`turn_labels` per the engine's contract, metrics, and the errors."""
from __future__ import annotations

import pytest
import torch

from llm_agent.diagnosis import annotated
from llm_agent.rollout.dialogue_record import records_from_batch
from llm_agent.reward import TURN_COMPONENTS, compute_reward
from llm_agent.scenario import load_scenario
from verl.trainer.ppo.diagnosis_reweight import turn_weights
from verl.trainer.ppo.turn_layout import TurnLayout, check_turn_scores

from tests.helpers.record_factory import SCENARIO_PATH, batch_of, random_records, typed

DIMS = ("cooperation", "emotion", "trust")
SPANS = {"cooperation": 4.0, "emotion": 3.0, "trust": 5.0}  # inbound_support.yaml's state ranges, read by hand
STAGES = (0, 1, 2, 3)  # its stage ids, in order
TURN_WEIGHTS = {"state_change": 2.0, "stage_progress": 0.5, "format": 1.5}


@pytest.fixture(scope="module")
def scenario():
    return load_scenario(SCENARIO_PATH)


def reference_turns(record):
    """Per turn (state change, stage progress, format) from the spec, with plain float64 arithmetic."""
    state = {d: float(record["profile"][d]) for d in DIMS}
    furthest = 0
    out = []
    for turn in record["turns"]:
        reported = turn["user_state"] or {}
        change = 0.0
        for d in DIMS:
            if reported.get(d) is not None:
                change += (reported[d] - state[d]) / SPANS[d]
                state[d] = float(reported[d])
        stage = turn["agent_stage"] if turn["agent_format_ok"] else None
        position = STAGES.index(stage) if stage in STAGES else -1
        progress = max(0, position - furthest) / (len(STAGES) - 1)
        furthest = max(furthest, position)
        out.append((change / 3.0, progress, -1.0 if not turn["agent_format_ok"] else 0.0))
    return out


def turn_ends(mask_row):
    """The positions of the last token of each run of 1s."""
    ends = [i for i in range(len(mask_row)) if mask_row[i] == 1 and (i + 1 == len(mask_row) or mask_row[i + 1] == 0)]
    return ends


@pytest.mark.parametrize("seed", [0, 1])
def test_turn_scores_and_components_match_reference(scenario, seed):
    records = random_records(seed, 160, scenario)
    data, _ = batch_of(records, seed)
    rewards, metrics = compute_reward(data, None, scenario=SCENARIO_PATH, turn_weights=TURN_WEIGHTS)
    scores = data.batch["turn_scores"]
    mask = data.batch["response_mask"]
    check_turn_scores(scores, mask)  # the engine's contract: finite, 0 off the agent turns
    expected = torch.zeros(mask.shape, dtype=torch.float64)
    raw_turns = []
    for i, record in enumerate(records):
        if record["outcome"] == "error":
            assert records_from_batch(data)[i].turn_rewards is None
            continue
        per_turn = reference_turns(record)
        raw_turns += per_turn
        totals = [TURN_WEIGHTS["state_change"] * c + TURN_WEIGHTS["stage_progress"] * p + TURN_WEIGHTS["format"] * f
                  for c, p, f in per_turn]
        assert records_from_batch(data)[i].turn_rewards == pytest.approx(totals, abs=1e-12)
        for end, total in zip(turn_ends(mask[i].tolist()), totals, strict=True):
            expected[i, end] = total
        # the per-turn state changes add up to the trajectory's raw state_transition
        transition = records_from_batch(data)[i].reward_components["state_transition"]
        assert transition == 0.0  # weight 0 by default ...
        assert sum(c for c, _, _ in per_turn) == pytest.approx(sum(
            (([float(record["profile"][d])] + [float(t["user_state"][d]) for t in record["turns"]
                                               if t["user_state"] and t["user_state"][d] is not None])[-1]
             - float(record["profile"][d])) / SPANS[d] for d in DIMS) / 3.0, abs=1e-12)
    torch.testing.assert_close(scores.double(), expected, atol=1e-6, rtol=0)
    assert rewards.sum().item() == pytest.approx(10.0 * sum(r["outcome"] == "completed" for r in records))
    for k, name in enumerate(TURN_COMPONENTS):
        raw_mean = sum(t[k] for t in raw_turns) / len(raw_turns)
        assert metrics[f"turn/raw/{name}"] == pytest.approx(raw_mean, abs=1e-12)
        assert metrics[f"turn/{name}"] == pytest.approx(TURN_WEIGHTS[name] * raw_mean, abs=1e-12)
    assert metrics["turn/total"] == pytest.approx(sum(TURN_WEIGHTS[n] * metrics[f"turn/raw/{n}"]
                                                      for n in TURN_COMPONENTS), abs=1e-12)


def test_default_turn_weights_write_no_turn_scores_but_labels(scenario):
    records = random_records(5, 40, scenario)
    data, _ = batch_of(records, seed=5)
    _, metrics = compute_reward(data, None, scenario=SCENARIO_PATH)
    assert "turn_scores" not in data.batch.keys() and "turn_rewards" not in data.non_tensor_batch
    assert all(metrics[f"turn/{name}"] == 0.0 for name in TURN_COMPONENTS)
    labels = data.non_tensor_batch["turn_labels"]
    assert labels.dtype == object and labels.shape == (len(records),)
    for i, record in enumerate(annotated(typed(records), scenario)):
        if record.outcome == "error":
            assert labels[i] is None
        else:
            assert labels[i] == [[e["label"] for e in t.diagnosis] for t in record.turns]
            assert len(labels[i]) == record.num_turns
    assert any(turn for row in labels if row for turn in row), "no labelled turn to check"


def test_labels_are_what_the_engine_reweights(scenario):
    """The column goes through the engine's own reader: the labelled turns of the records get their weight."""
    from verl.utils.agent_turns import agent_turn_ids_from_mask

    records = random_records(7, 60, scenario)
    data, _ = batch_of(records, seed=7)
    compute_reward(data, None, scenario=SCENARIO_PATH)
    layout = TurnLayout.from_turn_ids(agent_turn_ids_from_mask(data.batch["response_mask"]))
    found = turn_weights(data.non_tensor_batch["turn_labels"], layout, {"format_error": 2.0})
    formats = [(i, k) for i, r in enumerate(records) if r["outcome"] not in ("completed", "error")
               for k, t in enumerate(r["turns"]) if not t["agent_format_ok"]]
    assert formats and found.label_turns["format_error"] == len(formats)
    for i, k in formats:
        assert found.weights[i, k] == 2.0


def test_loop_turn_ids_decide_where_turn_scores_go(scenario):
    records = [r for r in random_records(9, 40, scenario) if r["outcome"] != "error" and r["num_turns"] >= 2][:4]
    for r in records:
        r.update(outcome="hung_up", turns=r["turns"][:2], num_turns=2)
    data, _ = batch_of(records, seed=9, length=10)
    data.batch["response_mask"] = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 0, 0, 0]] * len(records))
    # the loop's numbering: turn 0 = positions 0-1, turn 1 = position 2 and 5-6 (not the mask's runs)
    data.batch["agent_turn_ids"] = torch.tensor([[0, 0, 1, -1, -1, 1, 1, -1, -1, -1]] * len(records))
    compute_reward(data, None, scenario=SCENARIO_PATH, turn_weights={"format": 1.0, "state_change": 1.0})
    scores = data.batch["turn_scores"]
    for i in range(len(records)):
        first, second = records_from_batch(data)[i].turn_rewards
        expected = torch.zeros(10)
        expected[1], expected[6] = first, second
        torch.testing.assert_close(scores[i], expected)
    assert scores.abs().sum() > 0, "no non-zero turn score to place"


def test_a_record_that_does_not_match_its_row_is_an_error(scenario):
    records = [r for r in random_records(10, 20, scenario) if r["outcome"] != "error" and r["num_turns"] > 1][:3]
    data, _ = batch_of(records, seed=10)
    broken = records_from_batch(data)[1]
    broken.turns = broken.turns[:-1]
    with pytest.raises(ValueError, match=r"record 1 .*has \d+ agent turns but its row's response has \d+"):
        compute_reward(data, None, scenario=SCENARIO_PATH)


def test_bad_turn_weights_are_rejected(scenario):
    data, _ = batch_of(random_records(1, 4, scenario), seed=1)
    with pytest.raises(ValueError, match=r"turn_weights: unknown component\(s\) \['stage'\]"):
        compute_reward(data, None, scenario=SCENARIO_PATH, turn_weights={"stage": 1.0})
    with pytest.raises(ValueError, match="turn_weights.format must be a finite number"):
        compute_reward(data, None, scenario=SCENARIO_PATH, turn_weights={"format": float("inf")})
