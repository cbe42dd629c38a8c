"""Why calls failed, in the mistakes analysis: failure labels counted per label on hand-written dialogues (the
expected counts worked out by hand in the comments), logs without labels diagnosed when read, stored labels
kept, the analyze_mistakes command line printing them and the report's dialogue browser data carrying them."""
from __future__ import annotations

import json

import pytest

from for_evaluation import analyze_mistakes
from llm_agent.diagnosis import annotated
from llm_agent.evaluation.analysis import analyze_dialogues
from tests.helpers.record_factory import typed
from llm_agent.evaluation.browser_data import browser_payload

from tests.helpers.turn_records import record, turn

COST_DOUBT = "So what's this going to cost me in the end?"


def records():
    talked_past = turn("It's about this: more diners.", stage=1, user=COST_DOUBT)  # "free" would answer it
    return [
        # A: one turn talks past the cost doubt -> doubt_unanswered x1 (cost_concerns)
        record("hung_up", [turn(user=COST_DOUBT), dict(talked_past, user="Bye.", user_status=-1)], dialogue_id="a"),
        # B: a lone format error that runs out of turns -> format_error x1, timeout_loop x1
        record("timeout", [turn(ok=False, user="(note)", state=None, source="format_error")], dialogue_id="b"),
        # C: two turns talk past it -> doubt_unanswered x2 (cost_concerns)
        record("hung_up", [turn(user=COST_DOUBT), talked_past, dict(talked_past, user="Bye.", user_status=-1)],
               dialogue_id="c"),
        record("completed", [turn(user=COST_DOUBT), turn("Trial.", stage=1, user_status=1)], dialogue_id="d"),
        record("error", [turn(user=COST_DOUBT), turn("Trial.", stage=1)], dialogue_id="e"),
    ]


def test_failure_labels_by_hand(scenario):
    result = analyze_dialogues(typed(records()), scenario)["diagnosis"]
    assert result["failed"] == 3 and result["labelled"] == 3
    by_label = {row["label"]: row for row in result["labels"]}
    assert [row["label"] for row in result["labels"]][:3] == ["doubt_unanswered", "false_claim", "premature_push"]
    assert by_label["doubt_unanswered"] == {"label": "doubt_unanswered", "turns": 3, "dialogues": 2, "share": 2 / 3,
                                            "by_outcome": {"hung_up": 2}, "notes": {"cost_concerns": 3}}
    assert by_label["format_error"]["turns"] == 1 and by_label["format_error"]["by_outcome"] == {"timeout": 1}
    assert by_label["timeout_loop"]["dialogues"] == 1 and by_label["timeout_loop"]["share"] == pytest.approx(1 / 3)
    assert by_label["false_claim"]["turns"] == 0 and by_label["false_claim"]["share"] == 0.0


def test_labels_stored_in_a_log_are_kept(scenario):
    rows = [r.to_dict() for r in annotated(typed(records()[:1]), scenario)]  # a log line of an annotated record
    rows[0]["turns"] = [dict(t, diagnosis=[]) for t in rows[0]["turns"]]
    rows[0]["turns"][0]["diagnosis"] = [{"label": "custom_label", "note": "from the run"}]
    rows[0]["labels"] = {"custom_label": 1}
    result = analyze_dialogues(typed(rows), scenario)["diagnosis"]
    by_label = {row["label"]: row for row in result["labels"]}
    assert by_label["custom_label"]["notes"] == {"from the run": 1} and by_label["doubt_unanswered"]["turns"] == 0
    assert result["labels"][-1]["label"] == "custom_label"


def test_command_line_prints_the_diagnosis(tmp_path, capsys):
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps({"step": 1, "split": "train", **r}) + "\n" for r in records()))
    assert analyze_mistakes.main([str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {row["label"]: row for row in out["splits"]["train"]["diagnosis"]["labels"]}
    assert rows["doubt_unanswered"]["turns"] == 3 and rows["format_error"]["turns"] == 1
    # the default text summary names the labels of the failed calls with their shares
    assert analyze_mistakes.main([str(path)]) == 0
    why = [line for line in capsys.readouterr().out.splitlines() if "why they failed" in line]
    assert len(why) == 1
    for label in ("doubt_unanswered", "format_error"):
        assert f"{label} {rows[label]['share']:.0%}" in why[0]


def test_browser_data_carries_the_labels_of_every_turn(scenario):
    payload = browser_payload(annotated(typed(records()), scenario), scenario)
    by_id = {d["id"]: d for d in payload["dialogues"]}
    assert by_id["c"]["lb"] == {"doubt_unanswered": 2} and by_id["d"]["lb"] == {}
    talked_past = [["doubt_unanswered", "cost_concerns"]]
    assert [t["dx"] for t in by_id["c"]["t"]] == [[], talked_past, talked_past]
    assert by_id["b"]["t"][0]["dx"] == [["format_error", "no usable reply tag or an out-of-range tag"],
                                        ["timeout_loop", "no progress in the whole call"]]
    unlabelled = browser_payload(typed(records()[:1]), scenario)["dialogues"][0]  # a log written before the labels
    assert unlabelled["lb"] == {} and all(t["dx"] == [] for t in unlabelled["t"])
