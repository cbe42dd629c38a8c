"""Failure labels and per-turn signals on hand-written dialogues (the outbound scenario's rules, written out by hand
here): every label fires where the pattern is and nowhere else, completed calls and simulator errors get none, and
the signals match a computation from the spec."""
from __future__ import annotations

import math

import pytest

from llm_agent.diagnosis import annotate_record, annotated, diagnosis_metrics, turn_label_lists, turn_signals
from llm_agent.rollout.dialogue_record import DialogueRecord

from tests.helpers.turn_records import record as record_dict
from tests.helpers.turn_records import turn

SPANS = {"cooperation": 4, "emotion": 3, "trust": 5}  # outbound_ad_trial.yaml's state ranges, read by hand
COST_DOUBT = "So what's this going to cost me in the end?"  # a scripted cost_concerns doubt line


def record(*args, **kwargs) -> DialogueRecord:
    """The hand-written record, read as the loop's typed record."""
    return DialogueRecord.from_dict(record_dict(*args, **kwargs))


def labels_of(scenario, rec):
    annotate_record(rec, scenario)
    return turn_label_lists(rec)


def test_unanswered_doubt_labels_the_turn_that_talked_past_it(scenario):
    rec = record("hung_up", [
        turn(user="Speaking. " + COST_DOUBT),
        turn("I understand. It's about this: more diners.", stage=1, user=COST_DOUBT),   # talked past: labelled
        turn("On that point: it's free, no charge.", stage=1, user="Sounds like one of those scam calls to me."),
        turn("Next step: open the merchant app.", stage=2, user="Look, I don't have time for this. Bye.",
             user_status=-1),                             # past the scam doubt, and a step while cooperation is 2
    ])
    assert labels_of(scenario, rec) == [[], ["doubt_unanswered"], [], ["doubt_unanswered", "premature_push"]]
    notes = [[e["note"] for e in t.diagnosis if e["label"] == "doubt_unanswered"] for t in rec.turns]
    assert notes == [[], ["cost_concerns"], [], ["trust_and_scepticism"]]
    assert rec.labels == {"doubt_unanswered": 2, "premature_push": 1}


def test_generic_doubt_cues_and_cached_replies_count(scenario):
    rec = record("timeout", [turn(user="Wait, is there a hidden fee?", source="cache"),
                             turn("Quick check first: manager?", stage=0, state=(3, 2, 2))])
    assert labels_of(scenario, rec)[1] == ["doubt_unanswered"]
    assert rec.turns[1].diagnosis[0]["note"] == "cost_concerns"


def test_a_persons_doubt_counts_like_a_simulators(scenario):
    """A human call's turns (user_source "human") are diagnosed as a simulator's; a format note is not heard."""
    for source, expected in (("human", ["doubt_unanswered"]), ("format_error", [])):
        rec = record("timeout", [turn(user="Wait, is there a hidden fee?", source=source),
                                 turn("Quick check first: manager?", stage=0, state=(3, 2, 2))])
        assert labels_of(scenario, rec)[1] == expected, source


def test_false_claim_by_status_and_by_words(scenario):
    rec = record("agent_ended", [
        turn("Great, you're all set then.", stage=3, user="What? I did nothing yet."),      # claimed in words
        turn("Thanks, goodbye.", stage=3, status=1, user="Eh? No.", user_status=0),           # status 1, unconfirmed
    ])
    assert labels_of(scenario, rec) == [["false_claim"], ["false_claim"]]
    assert "you're all set" in rec.turns[0].diagnosis[0]["note"]


def test_premature_push_uses_the_state_after_the_turn(scenario):
    rec = record("hung_up", [
        turn("Next step: open the merchant app.", stage=2, state=(2, 2, 2)),    # cooperation 2 < 3: not ready
        turn("Now, please tap boost.", stage=2, state=(3, 2, 1)),                # ready: 3 and trust 1
        turn("You have to do it right now!", stage=2, state=(3, 2, 0), user_status=-1),   # trust 0 < 1
    ], initial=(1, 2, 2))
    assert labels_of(scenario, rec) == [["premature_push"], [], ["premature_push"]]
    assert rec.turns[0].diagnosis[0]["note"] == "cooperation 2 < 3"
    assert rec.turns[2].diagnosis[0]["note"] == "trust 0 < 1"


def test_hang_up_after_an_emotion_drop_within_the_window(scenario):
    rec = record("hung_up", [
        turn("Hello, this is Mia from FoodLoop.", state=(2, 1, 2)),   # a drop, but outside the last 2 turns
        turn("It's about this: a free trial.", stage=1, state=(2, 1, 2)),
        turn("Please be informed.", stage=1, state=(2, 0, 2)),         # emotion 1 -> 0
        turn("Okay then.", stage=1, state=(2, 0, 2), user_status=-1),
    ])
    assert labels_of(scenario, rec) == [[], [], ["hang_up_after_drop"], []]
    assert rec.turns[2].diagnosis[0]["note"] == "emotion -1"
    same_turns_no_hang_up = record("agent_ended", [t.to_dict() for t in rec.turns])
    assert all(not labels for labels in labels_of(scenario, same_turns_no_hang_up))


def test_format_error_and_loop_to_timeout(scenario):
    rec = record("timeout", [
        turn("Hello, this is Mia from FoodLoop.", stage=0, state=(2, 2, 3)),     # progress: trust up
        turn("It's about this: a free trial.", stage=1, state=(2, 2, 3)),       # progress: a new stage
        turn(ok=False, stage=3, user="(format note)", state=None, source="format_error"),   # stage not heard
        turn("It's about this: a free trial.", stage=1, state=(2, 1, 3)),
    ])
    assert labels_of(scenario, rec) == [[], [], ["format_error", "timeout_loop"], ["timeout_loop"]]
    assert rec.turns[3].diagnosis[0]["note"] == "no progress after turn 2"


def test_truncated_labels_the_last_turn(scenario):
    rec = record("truncated", [turn(), turn("It's about this: a free trial.", stage=1, state=None, source=None,
                                            user=None)])
    assert labels_of(scenario, rec) == [[], ["truncated"]]


@pytest.mark.parametrize("outcome", ["completed", "error"])
def test_completed_calls_and_simulator_errors_get_no_labels(scenario, outcome):
    rec = record(outcome, [turn(user=COST_DOUBT), turn(ok=False, status=1, user="(format note)", state=None,
                                                       source="format_error"),
                           turn("You have to do it right now!", stage=2, state=(0, 0, 0), user_status=-1)])
    assert labels_of(scenario, rec) == [[], [], []] and rec.labels == {}


def test_signals_match_the_spec(scenario):
    turns = [turn(stage=1, state=(3, 2, 2)), turn(ok=False, stage=3, state=None, source="format_error"),
             turn(stage=0, state=(3, 1, 4), source="cache"), turn(stage=2, state=None, source=None, user=None),
             turn(stage=None, state=(None, 3, None))]  # the simulator reported emotion only
    rec = record("hung_up", turns, initial=(2, 2, 2))
    signals = turn_signals(rec, scenario)
    deltas = [{"cooperation": 1, "emotion": 0, "trust": 0}, None, {"cooperation": 0, "emotion": -1, "trust": 2}, None,
              {"cooperation": 0, "emotion": 2, "trust": 0}]
    assert [s.state_delta for s in signals] == deltas
    changes = [0.0 if d is None else (d["cooperation"] / 4 + d["emotion"] / 3 + d["trust"] / 5) / 3 for d in deltas]
    assert [s.state_change for s in signals] == pytest.approx(changes, abs=1e-15)
    assert [s.state_before["trust"] for s in signals] == [2, 2, 2, 4, 4]
    # stages: 1, (3 unheard), 0, 2, none -> furthest 1, 1, 1, 2, 2; progress in positions / 3
    assert [s.stage_reached for s in signals] == [1, 1, 1, 2, 2]
    assert [s.new_stage for s in signals] == [True, False, False, True, False]
    assert [s.stage_progress for s in signals] == pytest.approx([1 / 3, 0, 0, 1 / 3, 0])
    assert [s.format_error for s in signals] == [False, True, False, False, False]
    moved = sum(abs(c) for c in changes)
    assert [s.outcome_share for s in signals] == pytest.approx([c / moved for c in changes])
    assert math.fsum(abs(s.outcome_share) for s in signals) == pytest.approx(1.0)


def test_annotated_leaves_the_callers_records_and_metrics_count_turns(scenario):
    raw = [record("hung_up", [turn(user=COST_DOUBT), turn("Quick check first: manager?")]),
           record("timeout", [turn(ok=False, user="(note)", state=None, source="format_error")]),
           record("completed", [turn(user_status=1)]), record("agent_ended", [turn(state=(2, 2, 2))])]
    out = annotated(raw, scenario)
    assert all(t.signals is None for r in raw for t in r.turns) and raw[0].labels is None
    assert annotated(out, scenario)[0] is out[0]  # already annotated: kept as is
    metrics = diagnosis_metrics(out, scenario)
    assert metrics["diagnosis/labels/doubt_unanswered"] == 1.0
    assert metrics["diagnosis/labels/format_error"] == 1.0 and metrics["diagnosis/labels/timeout_loop"] == 1.0
    assert metrics["diagnosis/labels/false_claim"] == 0.0 and "diagnosis/labels/truncated" in metrics
    assert metrics["diagnosis/labelled_failure_frac"] == pytest.approx(2 / 3)  # the agent_ended call: no label
