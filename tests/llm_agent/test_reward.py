"""Tests of llm_agent.reward: components against an independent float64 computation, placement, alignment."""
from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch

from llm_agent.reward import COMPONENTS, compute_reward
from llm_agent.rollout.dialogue_record import records_from_batch
from llm_agent.scenario import load_scenario
from verl.protocol import DataProto

from tests.helpers.record_factory import MAX_TURNS, SCENARIO_PATH, batch_of, random_records

DIMS = ("cooperation", "emotion", "trust")
SPANS = {"cooperation": 4.0, "emotion": 3.0, "trust": 5.0}  # inbound_support.yaml's state_ranges, read by hand
WEIGHTS = {"completion": 10.0, "state_transition": 2.5, "profile_accuracy": 1.5, "false_positive": 3.0,
           "turn_efficiency": 0.75, "format": 4.0}


@pytest.fixture(scope="module")
def scenario():
    """The inbound support scenario (ranges 0-4 / 0-3 / 0-5)."""
    return load_scenario(SCENARIO_PATH)


def reference_raw(r, max_turns):
    """Unit-weight components of one non-error record, written out from the spec with plain floats."""
    done = 1.0 if r["outcome"] == "completed" else 0.0
    transition = 0.0
    for d in DIMS:
        vals = [float(r["profile"][d])]
        vals += [float(t["user_state"][d]) for t in r["turns"] if t["user_state"] and t["user_state"][d] is not None]
        transition += (vals[-1] - vals[0]) / SPANS[d] if len(vals) >= 2 else 0.0
    accs = []
    for t in r["turns"]:
        a, u = t["agent_state"], t["user_state"]
        if a and u and all(a[d] is not None and u[d] is not None for d in DIMS):
            accs.append(1.0 - sum(abs(a[d] - u[d]) / SPANS[d] for d in DIMS) / 3.0)
    claimed = bool(r["turns"]) and r["turns"][-1]["agent_status"] == 1
    return {"completion": done, "state_transition": transition / 3.0,
            "profile_accuracy": sum(accs) / len(accs) if accs else 0.0,
            "false_positive": -1.0 if claimed and r["outcome"] != "completed" else 0.0,
            "turn_efficiency": done * (1.0 - r["num_turns"] / max_turns),
            "format": -r["format_errors"] / max(r["num_turns"], 1)}


@pytest.mark.parametrize("seed", [0, 1])
def test_components_placement_and_metrics_match_reference(scenario, seed):
    records = random_records(seed, 240, scenario)
    data, last = batch_of(records, seed)
    rewards, metrics = compute_reward(data, None, scenario=SCENARIO_PATH, weights=WEIGHTS,
                                      turn_efficiency_max_turns=MAX_TURNS)
    assert rewards.dtype == torch.float32 and rewards.shape == data.batch["response_mask"].shape
    raws, totals = [], []
    for i, r in enumerate(records):
        comps = records_from_batch(data)[i].reward_components
        if r["outcome"] == "error":
            assert last[i] == -1 and not rewards[i].any()
            assert records_from_batch(data)[i].reward == 0.0 and set(comps.values()) == {0.0}
            continue
        raw = reference_raw(r, MAX_TURNS)
        raws.append(raw)
        for name in COMPONENTS:
            assert comps[name] == pytest.approx(WEIGHTS[name] * raw[name], abs=1e-12), (i, name)
        total = sum(WEIGHTS[n] * raw[n] for n in COMPONENTS)
        totals.append(total)
        assert records_from_batch(data)[i].reward == pytest.approx(total, abs=1e-12)
        # the whole reward sits on the last agent token, after which come user blocks and padding
        assert rewards[i, last[i]].item() == pytest.approx(total, abs=1e-5)
        assert torch.count_nonzero(rewards[i]) == (total != 0.0)
    n = len(raws)
    for name in COMPONENTS:
        raw_mean = sum(raw[name] for raw in raws) / n
        assert metrics[f"raw/{name}"] == pytest.approx(raw_mean, abs=1e-12)
        assert metrics[name] == pytest.approx(WEIGHTS[name] * raw_mean, abs=1e-12)
    assert metrics["total"] == pytest.approx(sum(totals) / n, abs=1e-12)
    assert metrics["unplaced_rows"] == 0.0
    # every component is exercised with both signs/zero by the random records
    assert all(any(raw[name] != 0.0 for raw in raws) for name in COMPONENTS)


def test_hand_built_mask_with_user_blocks_and_padding(scenario):
    records = random_records(11, 2, scenario)
    records[0].update(outcome="completed", turns=records[0]["turns"][:2], num_turns=2)  # the mask's two agent spans
    records[1].update(outcome="error")
    data, _ = batch_of(records, seed=0, length=12)
    data.batch["response_mask"] = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0], [0] * 12])
    rewards, _ = compute_reward(data, None, scenario=SCENARIO_PATH)
    expected = torch.zeros(2, 12)
    expected[0, 7] = 10.0
    assert torch.equal(rewards, expected)


def test_default_weights_reward_completion_only(scenario):
    records = random_records(3, 200, scenario)
    data, _ = batch_of(records, seed=3)
    rewards, metrics = compute_reward(data, None, scenario=SCENARIO_PATH)
    sums = rewards.sum(dim=-1).tolist()
    assert set(sums) == {0.0, 10.0}
    assert sums == [10.0 if r["outcome"] == "completed" else 0.0 for r in records]
    assert all(metrics[n] == 0.0 for n in COMPONENTS if n != "completion")
    # unweighted components are still measured; turn_efficiency only once max_turns is known
    assert metrics["raw/profile_accuracy"] > 0.0 and "raw/turn_efficiency" not in metrics
    _, with_turns = compute_reward(data, None, scenario=SCENARIO_PATH, turn_efficiency_max_turns=MAX_TURNS)
    assert with_turns["raw/turn_efficiency"] > 0.0 and with_turns["turn_efficiency"] == 0.0


def test_reward_follows_its_dialogue_through_reorder(scenario):
    records = random_records(21, 96, scenario)
    data, _ = batch_of(records, seed=21)
    before = copy.deepcopy(data)
    kwargs = {"scenario": SCENARIO_PATH, "weights": WEIGHTS, "turn_efficiency_max_turns": MAX_TURNS}
    rewards_before, _ = compute_reward(before, None, **kwargs)
    by_dialogue = {r.dialogue_id: (r.reward, rewards_before[i]) for i, r in enumerate(records_from_batch(before))}
    perm = np.random.default_rng(0).permutation(len(data))
    assert (perm != np.arange(len(data))).mean() > 0.9
    data.reorder(perm)  # what the trainer's balancing does
    rewards_after, _ = compute_reward(data, None, **kwargs)
    assert len({r.reward for r in records_from_batch(before)}) > 20  # rewards differ enough to expose a mix-up
    for i, record in enumerate(records_from_batch(data)):
        reward, row = by_dialogue[record.dialogue_id]
        assert record.reward == reward
        assert torch.equal(rewards_after[i], row)


def test_unknown_or_bad_weight_is_rejected(scenario):
    data, _ = batch_of(random_records(1, 4, scenario), seed=1)
    with pytest.raises(ValueError, match=r"unknown component\(s\) \['completon'\].*'completion'.*'format'"):
        compute_reward(data, None, scenario=SCENARIO_PATH, weights={"completon": 1.0})
    with pytest.raises(ValueError, match="weights.format must be a finite number"):
        compute_reward(data, None, scenario=SCENARIO_PATH, weights={"format": float("nan")})
    with pytest.raises(ValueError, match="turn_efficiency_max_turns is not set"):
        compute_reward(data, None, scenario=SCENARIO_PATH, weights={"turn_efficiency": 1.0})
    with pytest.raises(ValueError, match="scenario is required"):
        compute_reward(data, None)


def test_missing_records_name_the_rollout_loop(scenario):
    data, _ = batch_of(random_records(2, 4, scenario), seed=2)
    data.non_tensor_batch.pop("dialogue")
    with pytest.raises(KeyError, match="'dialogue'.*llm_agent.generation.LLMGenerationManager"):
        compute_reward(data, None, scenario=SCENARIO_PATH)
    bare = DataProto.from_dict(non_tensors={"outcome": ["completed"]})
    with pytest.raises(KeyError, match="response_mask"):
        compute_reward(bare, None, scenario=SCENARIO_PATH)


def test_too_many_turns_for_max_turns_is_an_error(scenario):
    records = random_records(4, 30, scenario)
    data, _ = batch_of(records, seed=4)
    long_row = next(i for i, r in enumerate(records) if r["outcome"] != "error" and r["num_turns"] > 2)
    with pytest.raises(ValueError, match=f"record {long_row} .*exceeds reward.kwargs.turn_efficiency_max_turns=2"):
        compute_reward(data, None, scenario=SCENARIO_PATH, turn_efficiency_max_turns=2)


def test_scenario_loaded_once_per_run(scenario, caplog, tmp_path):
    """The reward, the training and the validation loop of a run share one parsed scenario: a file is parsed
    once per process and content (a copy elsewhere is a file of its own; an edited file is parsed again)."""
    path = tmp_path / "inbound.yaml"
    path.write_bytes(open(SCENARIO_PATH, "rb").read())
    data, _ = batch_of(random_records(6, 8, scenario), seed=6)
    with caplog.at_level(logging.INFO, logger="llm_agent.scenario"):
        for _ in range(3):
            compute_reward(data, None, scenario=str(path))
        assert load_scenario(path) is load_scenario(str(path))
    assert sum("loaded scenario" in rec.getMessage() for rec in caplog.records) == 1
    path.write_text(path.read_text().replace("Brightcart", "Shopwise"))
    edited = load_scenario(path)
    assert edited is not load_scenario(SCENARIO_PATH) and "Shopwise" in edited.description


def test_unplaced_reward_is_counted_and_logged(scenario, caplog):
    records = random_records(8, 3, scenario)
    for r in records:
        r["outcome"] = "completed"
    data, _ = batch_of(records, seed=8)
    data.batch["response_mask"][1] = 0
    with caplog.at_level(logging.WARNING, logger="llm_agent.reward"):
        rewards, metrics = compute_reward(data, None, scenario=SCENARIO_PATH)
    assert metrics["unplaced_rows"] == 1.0 and not rewards[1].any() and rewards[0].sum() == 10.0
    assert records[1]["dialogue_id"] in caplog.text
