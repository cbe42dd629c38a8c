"""Mistakes analysis on a hand-computed fixture: CRs, Wilson intervals, rankings, failures and the controller's
recommended weights (the expected numbers are worked out by hand in the comments)."""
from __future__ import annotations

import json
import math

import pytest

from for_evaluation import analyze_mistakes
from llm_agent.evaluation import analysis
from llm_agent.evaluation.analysis import parse_controller_overrides, wilson_interval
from llm_agent.rollout.dialogue_record import TurnRecord
from tests.helpers.record_factory import typed


def analyze_dialogues(records, *args, **kwargs):
    """The analysis of records given as rollout-log lines (read as `DialogueRecord`s, as the CLI reads them)."""
    return analysis.analyze_dialogues(typed(records), *args, **kwargs)


def analyze_by_split(records, *args, **kwargs):
    """`analysis.analyze_by_split` of records given as rollout-log lines."""
    return analysis.analyze_by_split(typed(records), *args, **kwargs)


def highest_stage(turns, stage_ids):
    """`analysis.highest_stage` of turns given as rollout-log turn objects."""
    return analysis.highest_stage([TurnRecord.from_dict(t, "turn") for t in turns], stage_ids)


def _dialogue(state, outcome, stages=(), behaviors=("A",), step=1, split="train"):
    c, e, t = state
    turns = [{"agent_stage": s} for s in stages]
    dialogue_id = f"{split}{step}-{c}{e}{t}-{outcome}-{''.join(map(str, stages))}"
    return {"step": step, "split": split, "dialogue_id": dialogue_id,
            "profile": {"cooperation": c, "emotion": e, "trust": t,
                        "behaviors": [{"category": f"cat_{b}", "behavior": f"behaviour {b}"} for b in behaviors]},
            "outcome": outcome, "num_turns": len(turns), "turns": turns}


# r1..r8 of the hand computation; r6 is an error and counts in no CR
RECORDS = [
    _dialogue((1, 1, 1), "completed", (0, 1, 2, 3), ("A",)),
    _dialogue((1, 1, 1), "hung_up", (0, 1), ("A", "B")),
    _dialogue((1, 2, 2), "completed", (0, 1, 2, 3), ("B",)),
    _dialogue((2, 2, 2), "timeout", (0, 1, 2), ("B",)),
    _dialogue((2, 2, 2), "hung_up", (None,), ("C",)),
    _dialogue((2, 1, 1), "error", (0,), ("C",)),
    _dialogue((3, 2, 3), "agent_ended", (2, 0), ("A",)),
    _dialogue((1, 1, 1), "completed", (0, 1, 2, 3, 3), ("C",)),
]


def _wilson_by_quadratic(k, n, z=1.959963984540054):
    """The Wilson bounds as the roots of (1 + z^2/n) x^2 - (2p + z^2/n) x + p^2 = 0 (another derivation)."""
    p = k / n
    a, b, c = 1 + z * z / n, -(2 * p + z * z / n), p * p
    disc = math.sqrt(b * b - 4 * a * c)
    return (-b - disc) / (2 * a), (-b + disc) / (2 * a)


@pytest.mark.parametrize("k,n", [(3, 4), (0, 2), (1, 3), (2, 3), (0, 1), (5, 5), (17, 40)])
def test_wilson_interval_matches_the_quadratic_roots(k, n):
    low, high = wilson_interval(k, n)
    ref_low, ref_high = _wilson_by_quadratic(k, n)
    assert low == pytest.approx(max(0.0, ref_low), abs=1e-12)
    assert high == pytest.approx(min(1.0, ref_high), abs=1e-12)


def test_wilson_interval_published_values():
    assert wilson_interval(3, 4) == pytest.approx((0.3006, 0.9544), abs=1e-4)
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_cr_per_value_and_combination_by_hand(scenario):
    a = analyze_dialogues(RECORDS, scenario, min_count=1, top_k=2)
    assert (a["n_dialogues"], a["n_errors"], a["n_scored"]) == (8, 1, 7)
    assert (a["completion"]["completed"], a["completion"]["n"]) == (3, 7)

    def table(dim):
        return {r["value"]: (r["completed"], r["n"]) for r in a["by_dimension"][dim]}
    assert table("cooperation") == {1: (3, 4), 2: (0, 2), 3: (0, 1)}  # the error (c=2) is left out
    assert table("emotion") == {1: (2, 3), 2: (1, 4)}
    assert table("trust") == {1: (2, 3), 2: (1, 3), 3: (0, 1)}
    c1 = a["by_dimension"]["cooperation"][0]
    assert c1["cr"] == 0.75 and (c1["ci_low"], c1["ci_high"]) == pytest.approx((0.3006, 0.9544), abs=1e-4)
    combos = {c["state_key"]: (c["completed"], c["n"]) for c in a["by_combination"]}
    assert combos == {"c1-e1-t1": (2, 3), "c1-e2-t2": (1, 1), "c2-e2-t2": (0, 2), "c3-e2-t3": (0, 1)}
    # hardest: both CR 0, c2-e2-t2 has the tighter upper bound (0/2 vs 0/1); easiest: 1/1 then 2/3
    assert [c["state_key"] for c in a["hardest"]] == ["c2-e2-t2", "c3-e2-t3"]
    assert [c["state_key"] for c in a["easiest"]] == ["c1-e2-t2", "c1-e1-t1"]
    assert [c["state_key"] for c in analyze_dialogues(RECORDS, scenario, min_count=2)["hardest"]] == \
        ["c2-e2-t2", "c1-e1-t1"]


def test_cr_per_behaviour_by_hand(scenario):
    a = analyze_dialogues(RECORDS, scenario)
    # A: r1 completed, r2, r7 not; B: r3 completed, r2, r4 not; C: r8 completed, r5 not (r6 is an error)
    behaviours = {r["behavior"]: (r["completed"], r["n"]) for r in a["by_behavior"]}
    assert behaviours == {"behaviour A": (1, 3), "behaviour B": (1, 3), "behaviour C": (1, 2)}
    assert [r["behavior"] for r in a["by_behavior"]] == ["behaviour A", "behaviour B", "behaviour C"]  # by CR
    categories = {r["category"]: (r["completed"], r["n"]) for r in a["by_behavior_category"]}
    assert categories == {"cat_A": (1, 3), "cat_B": (1, 3), "cat_C": (1, 2)}


def test_where_failed_calls_end_by_hand(scenario):
    f = analyze_dialogues(RECORDS, scenario)["failures"]
    # failed (not completed, not error): r2 stage 1 hung_up, r4 stage 2 timeout, r5 no stage hung_up,
    # r7 stages (2, 0) -> highest 2, agent_ended
    assert f["n"] == 4
    assert f["by_outcome"] == {"hung_up": 2, "agent_ended": 1, "timeout": 1, "truncated": 0}
    rows = {r["stage"]: (r["n"], r["by_outcome"]) for r in f["by_stage"]}
    assert rows == {1: (1, {"hung_up": 1}), 2: (2, {"agent_ended": 1, "timeout": 1}), "none": (1, {"hung_up": 1})}
    assert [r["name"] for r in f["by_stage"]][:2] == [scenario.stages[1].name, scenario.stages[2].name]
    assert highest_stage([{"agent_stage": 3}, {"agent_stage": 0}], scenario.stage_ids) == 3
    assert highest_stage([{"agent_stage": 99}], scenario.stage_ids) is None


def test_recommended_weights_by_hand(scenario):
    # CR 3/7, target 0.5: deviation -0.0714 is inside the dead band 0.1, so w(v) = 1 + 0.1 / count(v);
    # cooperation's valid values 1, 2, 3 (range 0..4 without extremes) were seen 4, 2, 1 times
    w = analyze_dialogues(RECORDS, scenario)["recommended_weights"]
    raw = [1 + 0.1 / 4, 1 + 0.1 / 2, 1 + 0.1 / 1]
    assert w["weights"]["cooperation"] == pytest.approx({str(v): x / sum(raw) for v, x in zip((1, 2, 3), raw)})
    assert w["cr"] == pytest.approx(3 / 7) and w["n"] == 7
    # target 0.9: deviation 3/7 - 0.9 < -0.1, so w(v) = 1 + 2|d| sr(v) with sr = 3/4, 0, 0
    d = 0.9 - 3 / 7
    w = analyze_dialogues(RECORDS, scenario, controller={"target_completion_rate": 0.9})["recommended_weights"]
    raw = [1 + 2 * d * 0.75, 1.0, 1.0]
    assert w["weights"]["cooperation"] == pytest.approx({str(v): x / sum(raw) for v, x in zip((1, 2, 3), raw)})
    # emotion: valid values 1, 2 with success rates 2/3 and 1/4
    raw = [1 + 2 * d * 2 / 3, 1 + 2 * d * 1 / 4]
    assert w["weights"]["emotion"] == pytest.approx({"1": raw[0] / sum(raw), "2": raw[1] / sum(raw)})


def test_splits_and_step_range(scenario):
    records = RECORDS + [_dialogue((1, 1, 1), "completed", step=5, split="val"),
                         _dialogue((2, 2, 2), "hung_up", step=7, split="val")]
    result = analyze_by_split(records, scenario)
    assert set(result["splits"]) == {"train", "val"} and result["splits"]["val"]["n_dialogues"] == 2
    only = analyze_by_split(records, scenario, split="val", max_step=6)
    assert list(only["splits"]) == ["val"] and only["splits"]["val"]["completion"]["cr"] == 1.0
    with pytest.raises(ValueError, match="no dialogues of split 'test'"):
        analyze_by_split(records, scenario, split="test")


def test_bad_record_is_named(scenario):
    bad = dict(RECORDS[0], profile={"cooperation": "high", "emotion": 1, "trust": 1})
    with pytest.raises(ValueError, match=r"record 1 .*'profile' must hold integer"):
        analyze_dialogues([RECORDS[0], bad], scenario)


def test_cli_writes_json(tmp_path, capsys):
    path = tmp_path / "agent_dialogues.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    out = tmp_path / "mistakes.json"
    assert analyze_mistakes.main([str(path), "--out", str(out), "--controller", "target_completion_rate=0.9"]) == 0
    result = json.loads(out.read_text())
    assert result["source"] == str(path) and result["scenario"] == "outbound_ad_trial"
    assert result["splits"]["train"]["recommended_weights"]["config"]["target_completion_rate"] == 0.9
    assert capsys.readouterr().out.strip() == str(out)


def test_cli_errors_name_the_problem(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        analyze_mistakes.main([str(path), "--controller", "target"])
    with pytest.raises(SystemExit, match="target_cr"):
        analyze_mistakes.main([str(path), "--controller", "target_cr=0.5"])
    with pytest.raises(SystemExit, match="no dialogues of split 'val'"):
        analyze_mistakes.main([str(path), "--split", "val"])
    assert parse_controller_overrides(["joint=true", "floor=0.01"]) == {"joint": True, "floor": 0.01}


def test_cli_without_arguments_summarises_the_latest_run(tmp_path, capsys, monkeypatch):
    log = tmp_path / "outputs" / "rollouts" / "exp" / "rollouts.jsonl"
    log.parent.mkdir(parents=True)
    log.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    monkeypatch.chdir(tmp_path)
    assert analyze_mistakes.main(["--min-count", "2"]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0] == "dialogues: outputs/rollouts/exp/rollouts.jsonl"
    # r1..r8: 7 scored, 3 completed (r1, r3, r8); Wilson bounds of 3/7 worked out in the tests above
    low, high = wilson_interval(3, 7)
    assert (f"train: 8 dialogues (1 simulator errors, left out of every CR); CR 0.429 [{low:.3f}, {high:.3f}] "
            "(3/7)") in lines
    assert any(line.startswith("  hardest initial states (>= 2 dialogues): c2-e2-t2 CR 0.000") for line in lines)
    assert len(lines) < 15 and "{" not in text  # a summary, not the JSON
    assert analyze_mistakes.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["splits"]["train"]["n_dialogues"] == 8
