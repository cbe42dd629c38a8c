"""Checking one LLM answer: scores never taken from it, behaviours only from the library, repairs counted."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from llm_agent.profiles.answers import check_answer, profile_request
from llm_agent.profiles.rules import load_rule_table
from llm_agent.scenario import DEFAULT_SCENARIO_PATH, load_scenario

REPO = Path(__file__).resolve().parents[3]
SCENARIO = load_scenario(DEFAULT_SCENARIO_PATH)
LIB = SCENARIO.behaviors
STATE = (2, 1, 4)  # trust level 0.8: trust_and_scepticism and identity_verification contradict it


def check(text, state=STATE, rules=None, lo=1, hi=3):
    return check_answer(text, dict(zip(SCENARIO.dims, state)), LIB, lo, hi, rules, SCENARIO.state_ranges)


def test_request_shows_state_and_numbered_library():
    user = profile_request(SCENARIO, STATE, 1, 3)[1]["content"]
    assert "- trust: 4 on a scale from 0 to 5" in user and "- cooperation: 2 on a scale from 0 to 4" in user
    assert f"{len(LIB)}. [{LIB[-1].category}] {LIB[-1].behavior}" in user


def test_numbers_and_exact_texts_are_taken_in_order():
    got = check(json.dumps({"cooperation": 2, "behaviors": [19, LIB[40].behavior.upper()]}))
    assert got.accepted and not got.repairs
    assert got.profile.behaviors == (LIB[18], LIB[40])
    assert (got.profile.state["cooperation"], got.profile.state["trust"]) == (2, 4)


def test_changed_score_rejects_the_whole_answer():
    got = check(json.dumps({"cooperation": 2, "emotion": 1, "trust": 5, "behaviors": [19]}))
    assert not got.accepted and got.reject_reason == "score_changed" and "trust 5 instead of 4" in got.detail


@pytest.mark.parametrize("text", ["I think cost concerns.", '{"behaviours": [1]}', "[1, 2]", '{"behaviors": 3}'])
def test_malformed_answers_are_rejected(text):
    assert check(text).reject_reason == "malformed"


def test_near_verbatim_text_in_a_fence_is_repaired_and_invented_ones_dropped():
    near = LIB[25].behavior.lower().rstrip(".") + "!"
    got = check("```json\n" + json.dumps({"behaviors": [near, "Sings a song.", 500, True]}) + "\n```")
    assert got.accepted and got.profile.behaviors == (LIB[25],)
    assert sum("repaired" in r for r in got.repairs) == 1 and sum("not in the library" in r for r in got.repairs) == 3


def test_only_invented_behaviours_reject_as_out_of_library():
    assert check(json.dumps({"behaviors": ["Sings a song."]})).reject_reason == "out_of_library"


def test_repeats_dropped_and_excess_cut():
    got = check(json.dumps({"behaviors": [20, 20, 21, 22, 23]}))
    assert got.profile.behaviors == (LIB[19], LIB[20], LIB[21])
    assert any("repeated" in r for r in got.repairs) and any("cut to the first 3" in r for r in got.repairs)


def test_rule_check_drops_contradicting_behaviours_or_rejects():
    sceptic = next(i for i, b in enumerate(LIB, 1) if b.category == "trust_and_scepticism")
    cost = next(i for i, b in enumerate(LIB, 1) if b.category == "cost_concerns")
    rules = load_rule_table()
    kept = check(json.dumps({"behaviors": [sceptic, cost]}), rules=rules)
    assert kept.profile.behaviors == (LIB[cost - 1],) and any("contradicts the state" in r for r in kept.repairs)
    assert check(json.dumps({"behaviors": [sceptic]}), rules=rules).reject_reason == "inconsistent"
    assert check(json.dumps({"behaviors": [sceptic]})).accepted  # without the rule table the LLM's choice stands
