"""Tests of llm_agent.metrics: every metric against an independent float64 computation, edge cases, errors."""
from __future__ import annotations

import copy
import math

import pytest

from llm_agent.metrics import metric_keys, records_from_batch, stages_complete
from llm_agent.metrics import dialogue_metrics as typed_metrics
from llm_agent.rollout.dialogue_record import DialogueRecord, TurnRecord
from llm_agent.scenario import load_scenario
from verl.protocol import DataProto

from tests.helpers.record_factory import SCENARIO_PATH, batch_of, object_column, random_records, typed

DIMS = ("cooperation", "emotion", "trust")


@pytest.fixture(scope="module")
def scenario():
    """The inbound support scenario (ranges 0-4 / 0-3 / 0-5, stages 0-3)."""
    return load_scenario(SCENARIO_PATH)


def _values(turns, key, dim):
    out = []
    for t in turns:
        s = t[key]
        if s is not None and s[dim] is not None:
            out.append(float(s[dim]))
    return out


def _delta(vals):
    return vals[-1] - vals[0] if len(vals) > 1 else 0.0


def _ratio(num, den):
    """num / den, None (undefined) when den is 0."""
    return num / den if den else None


def reference_metrics(records):
    """The spec's formulas written out with plain float64 loops; undefined metrics (empty denominator) left out."""
    ok = [r for r in records if r["outcome"] != "error"]
    n = len(ok)
    ref = {"n_dialogues": float(len(records)),
           "error_rate": _ratio(len(records) - n, len(records)),
           "completion_rate_all": _ratio(sum(1.0 for r in records if r["outcome"] == "completed"), len(records)),
           "sim_reply_retries": float(sum(r.get("sim_retries", 0) for r in records))}
    for outcome, key in [("completed", "completion_rate"), ("hung_up", "hang_up_rate"),
                         ("timeout", "timeout_rate"), ("truncated", "truncated_rate"),
                         ("agent_ended", "agent_ended_rate")]:
        ref[key] = _ratio(sum(1.0 for r in ok if r["outcome"] == outcome), n)
    done = [float(r["num_turns"]) for r in ok if r["outcome"] == "completed"]
    ref["att"] = _ratio(sum(done), len(done))
    ref["adt"] = _ratio(sum(float(r["num_turns"]) for r in ok), n)
    errs = []
    for r in ok:
        for t in r["turns"]:
            a, u = t["agent_state"], t["user_state"]
            if a is None or u is None or any(a[d] is None or u[d] is None for d in DIMS):
                continue
            # inbound_support.yaml's ranges, read by hand: cooperation 0-4, emotion 0-3, trust 0-5
            errs.append((abs(a["cooperation"] - u["cooperation"]) / 4.0 + abs(a["emotion"] - u["emotion"]) / 3.0
                         + abs(a["trust"] - u["trust"]) / 5.0) / 3.0)
    ref["upa"] = 1.0 - sum(errs) / len(errs) if errs else None
    for key, dim in [("ei", "emotion"), ("ti", "trust"), ("ci", "cooperation")]:
        sim = [_delta([float(r["profile"][dim])] + _values(r["turns"], "user_state", dim)) for r in ok]
        agent = [_delta(_values(r["turns"], "agent_state", dim)) for r in ok]
        ref[key] = _ratio(sum(sim), n)
        ref[key + "_agent"] = _ratio(sum(agent), n)
    complete = 0
    for r in ok:
        stages = [t["agent_stage"] for t in r["turns"] if t["agent_stage"] is not None]
        complete += bool(stages) and all(s in stages for s in range(max(stages)))
    ref["stage_completeness"] = _ratio(complete, n)
    claimed = [r for r in ok if r["turns"] and r["turns"][-1]["agent_status"] == 1]
    fp = [r for r in claimed if r["outcome"] != "completed"]
    ref["false_positive_rate"] = _ratio(len(fp), len(claimed))
    turns = sum(r["num_turns"] for r in ok)
    ref["format_error_rate"] = _ratio(sum(r["format_errors"] for r in ok), turns)
    user_turns = sum(1 for r in ok for t in r["turns"] if t["user_source"] in ("simulator", "cache"))
    ref["cache_hit_rate"] = _ratio(sum(r["cache_hits"] for r in ok), user_turns)
    for field, key in [("agent_tokens", "agent_tokens_per_dialogue"), ("sim_requests", "sim_requests_per_dialogue"),
                       ("wall_s", "seconds_per_dialogue")]:
        carried = [float(r[field]) for r in records if r.get(field) is not None]
        ref[key] = _ratio(sum(carried), len(carried))
    return {k: v for k, v in ref.items() if v is not None}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_metrics_match_independent_reference(scenario, seed):
    records = random_records(seed, 300, scenario)
    got = dialogue_metrics(records, scenario)
    ref = reference_metrics(records)
    keys = metric_keys(scenario)
    assert set(got) == set(keys) == set(ref)  # the generator gives every metric a denominator
    for key in keys:
        assert got[key] == pytest.approx(ref[key], rel=1e-12, abs=1e-12), key
        assert math.isfinite(got[key])
    # the generator reaches every branch the metrics distinguish
    assert 0 < got["error_rate"] < 1 and 0 < got["false_positive_rate"] < 1 and 0 < got["cache_hit_rate"] < 1
    assert 0 < got["format_error_rate"] < 1 and 0 < got["stage_completeness"] < 1


def test_upa_normalises_each_dimension_by_its_own_range(scenario):
    turn = {"agent_state": {"cooperation": 4, "emotion": 0, "trust": 0},
            "user_state": {"cooperation": 0, "emotion": 3, "trust": 5}, "agent_stage": 0, "agent_status": 0,
            "user_source": "simulator"}
    half = {**turn, "agent_state": {"cooperation": 2, "emotion": 0, "trust": 5}}  # errors 2/4, 3/3, 0/5
    record = {"profile": {"cooperation": 0, "emotion": 0, "trust": 0}, "outcome": "completed", "num_turns": 2,
              "turns": [turn, half], "cache_hits": 0, "format_errors": 0}
    got = dialogue_metrics([record], scenario)
    assert got["upa"] == pytest.approx(1.0 - (1.0 + (0.5 + 1.0 + 0.0) / 3.0) / 2.0)
    # the profile is the first simulator value: emotion 0 -> 3, agent estimates 0 -> 0
    assert got["ei"] == 3.0 and got["ei_agent"] == 0.0 and got["ti"] == 5.0 and got["ci_agent"] == -2.0


def test_att_is_completed_only_and_adt_all(scenario):
    records = random_records(5, 40, scenario)
    turn = random_records(5, 1, scenario)[0]["turns"][0]
    for r, (outcome, turns) in zip(records, [("completed", 2), ("hung_up", 6), ("completed", 4), ("error", 0)] * 10):
        r.update(outcome=outcome, num_turns=turns, turns=[dict(turn) for _ in range(turns)])
    got = dialogue_metrics(records, scenario)
    assert got["att"] == 3.0 and got["adt"] == 4.0 and got["error_rate"] == 0.25 and got["n_dialogues"] == 40


def test_empty_denominators_leave_the_metric_undefined_never_zero(scenario):
    records = [r for r in random_records(3, 100, scenario) if r["outcome"] == "error"][:5]
    got = dialogue_metrics(records, scenario)
    # only errors: nothing but the counts over all dialogues and the costs is defined
    assert set(got) == {"n_dialogues", "error_rate", "completion_rate_all", "sim_reply_retries",
                        "agent_tokens_per_dialogue", "sim_requests_per_dialogue", "seconds_per_dialogue"}
    assert got["error_rate"] == 1.0 and got["completion_rate_all"] == 0.0
    assert dialogue_metrics([], scenario) == {"n_dialogues": 0.0, "sim_reply_retries": 0.0}
    # no call completed and no claim: ATT and FPR are undefined, ADT is not
    hung = [{**r, "outcome": "hung_up", "turns": [{**t, "agent_status": 0} for t in r["turns"]]}
            for r in random_records(4, 20, scenario) if r["outcome"] != "error"]
    got = dialogue_metrics(hung, scenario)
    assert "att" not in got and "false_positive_rate" not in got and got["adt"] > 0 and got["completion_rate"] == 0.0
    # a log without the cost fields (written before they existed, or null in the JSON line) has no cost metrics
    old = [{k: v for k, v in r.items() if k not in ("agent_tokens", "sim_requests")} | {"wall_s": None} for r in hung]
    assert not {"agent_tokens_per_dialogue", "sim_requests_per_dialogue", "seconds_per_dialogue"} & set(
        dialogue_metrics(old, scenario))


def test_stage_completeness_rule():
    ids = (0, 1, 2, 3)

    def turns(*stages):
        return [TurnRecord(agent_text="", agent_stage=s) for s in stages]

    assert stages_complete(turns(0, 1, 2, 1, 3), ids)
    assert stages_complete(turns(0, 0, None), ids)
    assert not stages_complete(turns(0, 2, 3), ids)
    assert not stages_complete(turns(None), ids)
    with pytest.raises(ValueError, match="agent_stage 7"):
        stages_complete(turns(7), ids, "record 3")


def test_bad_records_name_the_problem(scenario):
    good = random_records(4, 1, scenario)[0]
    good["outcome"] = "completed"
    with pytest.raises(ValueError, match="record 0 .*outcome 'won'"):
        dialogue_metrics([{**good, "outcome": "won"}], scenario)
    with pytest.raises(KeyError, match="record 0 .*'turns'"):
        dialogue_metrics([{k: v for k, v in good.items() if k != "turns"}], scenario)
    with pytest.raises(ValueError, match="record 0 .*num_turns=9 but the record holds"):
        dialogue_metrics([{**good, "num_turns": 9}], scenario)
    with pytest.raises(ValueError, match="'cache_hits' must be a non-negative int"):
        dialogue_metrics([{**good, "cache_hits": -1}], scenario)
    for bad in (float("nan"), -1.0, "3"):
        with pytest.raises(ValueError, match="'wall_s' must be a finite number >= 0"):
            dialogue_metrics([{**good, "wall_s": bad}], scenario)


def test_records_from_batch_are_the_loops_own_records_and_missing_ones_name_the_loop(scenario):
    records = random_records(7, 12, scenario)
    data, _ = batch_of(records, seed=7)
    rows = records_from_batch(data)
    assert rows == list(data.non_tensor_batch["dialogue"]) and all(isinstance(r, DialogueRecord) for r in rows)
    scalars = [k for k in records[0] if k != "turns"]
    assert [r.to_dict()[k] for r in rows for k in scalars] == [r[k] for r in records for k in scalars]
    assert [[{k: t[k] for k in records[0]["turns"][0]} for t in r.to_dict()["turns"]] for r in rows] == \
        [r["turns"] for r in records]  # the log's turn keys, plus policy_version (None: not reported)
    assert typed_metrics(rows, scenario) == dialogue_metrics(copy.deepcopy(records), scenario)
    partial = DataProto.from_dict(non_tensors={"outcome": object_column([r["outcome"] for r in records])})
    with pytest.raises(KeyError, match="'dialogue'.*LLMGenerationManager"):
        records_from_batch(partial)


def dialogue_metrics(records, scenario):
    """The metrics of records given in the rollout log's JSON form (read as `DialogueRecord`s, as logs are)."""
    return typed_metrics(typed(records), scenario)
