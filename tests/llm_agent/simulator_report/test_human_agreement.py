"""The simulator report card's `human` section: the scripted persona's and a simulator's previews graded against
hand-written human calls, with the agreement worked out by hand below."""
from __future__ import annotations

import json
import random

import pytest

from for_evaluation import simulator_report
from llm_agent.evaluation.report_simulator import render_simulator_page
from llm_agent.metrics import user_turn_count
from llm_agent.rollout.dialogue_record import TurnRecord
from tests.helpers.report_fixtures import synthetic_dialogue

C, E, T = "cooperation", "emotion", "trust"


def _state(c, e, t):
    return {C: c, E: e, T: t}


def _answer(state, status, valid=True):
    return {"reply": "...", "state": _state(*state), "status": status, "format_valid": valid}


def _turn(source, state=None, status=None):
    return TurnRecord(agent_text="<reply>hello</reply>", agent_reply="hello", user_reply="fine" if source else None,
                      user_status=status, user_state=None if state is None else _state(*state),
                      user_source=source).to_dict()


def _call(name, initial, turns, previews):
    return {"step": 0, "split": "eval", "dialogue_id": f"{name}#0", "profile": _state(*initial),
            "outcome": "completed", "turns": turns, "judge": "human", "previews": previews}


# Call A from (2, 2, 2): the person says (3, 2, 3) continue, then after a format error (3, 3, 3)... see below.
# Call B from (1, 1, 1): the person hangs up at (1, 0, 2). Call C from (2, 2, 2): (2, 1, 2), no simulator asked.
CALLS = [
    _call("A", (2, 2, 2),
          [_turn("human", (3, 2, 3), 0), _turn("format_error"), _turn("human", (4, 3, 3), 1)],
          [{"scripted": _answer((3, 1, 3), 0), "simulator": _answer((3, 2, 3), 0)},
           {"scripted": _answer((4, 3, 4), 1), "simulator": {"error": "timed out"}}]),
    _call("B", (1, 1, 1), [_turn("human", (1, 0, 2), -1)],
          [{"scripted": _answer((0, 0, 2), 0), "simulator": {"reply": "x", "state": {C: 1, E: 0, T: None},
                                                             "status": -1, "format_valid": False}}]),
    _call("C", (2, 2, 2), [_turn("human", (2, 1, 2), 0), _turn(None)],
          [{"scripted": _answer((2, 1, 2), 0), "simulator": None}]),
]
# Scripted, per turn (previous state: the person's last report, the profile's before the first):
#   A0 prev (2,2,2): person (3,2,3) = (+,0,+); scripted (3,1,3) = (+,-,+): state c T e F t T, direction c T e F t T,
#      status 0=0 T
#   A2 prev (3,2,3): person (4,3,3) = (+,+,0); scripted (4,3,4) = (+,+,+): state c T e T t F, direction c T e T t F,
#      status 1=1 T
#   B0 prev (1,1,1): person (1,0,2) = (0,-,+); scripted (0,0,2) = (-,-,+): state c F e T t T, direction c F e T t T,
#      status 0 vs -1 F
#   C0 prev (2,2,2): person (2,1,2); scripted (2,1,2): everything T
SCRIPTED = {"format_valid_rate": 4 / 4, "state_agreement": 1 / 4, "direction_agreement": 1 / 4,
            "status_agreement": 3 / 4, f"state_agreement/{C}": 3 / 4, f"state_agreement/{E}": 3 / 4,
            f"state_agreement/{T}": 3 / 4, f"direction_agreement/{C}": 3 / 4, f"direction_agreement/{E}": 3 / 4,
            f"direction_agreement/{T}": 3 / 4}
# Simulator, on the turns it was asked (A0, A2, B0):
#   A0: (3,2,3) continue = the person's: everything T, format T
#   A2: an error: everything F
#   B0 prev (1,1,1): (1,0,None) hung up, malformed: state c T e T t F, direction c T e T t F, status T, format F
SIMULATOR = {"format_valid_rate": 1 / 3, "state_agreement": 1 / 3, "direction_agreement": 1 / 3,
             "status_agreement": 2 / 3, f"state_agreement/{C}": 2 / 3, f"state_agreement/{E}": 2 / 3,
             f"state_agreement/{T}": 1 / 3, f"direction_agreement/{C}": 2 / 3, f"direction_agreement/{E}": 2 / 3,
             f"direction_agreement/{T}": 1 / 3}
# A wrong reading (directions from the profile's initial state, not the previous report) would make A2's direction
# (+,+,+) for both the person and the scripted persona: all-dimension direction agreement 2/4, trust 4/4.
WRONG_SCRIPTED_DIRECTION, WRONG_SCRIPTED_TRUST = 2 / 4, 4 / 4


def _write(tmp_path, scenario, calls):
    rng = random.Random(5)
    simulated = [synthetic_dialogue(rng, scenario, i, 0, "eval") for i in range(2)]
    path = tmp_path / "human_dialogues.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in simulated + calls))
    return path


def _card(tmp_path, scenario, calls, bootstrap):
    out = tmp_path / "card.json"
    assert simulator_report.main(["--dialogues", str(_write(tmp_path, scenario, calls)), "--out", str(out),
                                  "--bootstrap", str(bootstrap), "--name", "people"]) == 0
    return json.loads(out.read_text())


def test_previews_graded_against_the_person_by_hand(scenario, tmp_path, capsys):
    card = _card(tmp_path, scenario, CALLS, 0)
    human = card["human"]
    assert (human["n_calls"], human["n_person_turns"]) == (3, 4)
    assert card["n_dialogues"] == 2  # the simulated dialogues alone are graded as simulator turns
    scripted, simulator = human["sources"]["scripted"], human["sources"]["simulator"]
    assert (scripted["n_turns"], scripted["n_errors"], simulator["n_turns"], simulator["n_errors"]) == (4, 0, 3, 1)
    assert scripted["metrics"] == pytest.approx(SCRIPTED)
    assert simulator["metrics"] == pytest.approx(SIMULATOR)
    assert scripted["metrics"]["direction_agreement"] != pytest.approx(WRONG_SCRIPTED_DIRECTION)
    assert scripted["metrics"][f"direction_agreement/{T}"] != pytest.approx(WRONG_SCRIPTED_TRUST)
    assert scripted["status_pairs"] == {"agreed->agreed": 1, "continue->continue": 2, "hung up->continue": 1}
    assert simulator["status_pairs"] == {"agreed->error": 1, "continue->continue": 1, "hung up->hung up": 1}
    printed = capsys.readouterr().out
    assert "people:scripted" in printed and "people:simulator" in printed
    row = next(line for line in printed.splitlines() if line.startswith("status_agreement "))
    assert row.split() == ["status_agreement", "0.750", "0.667"]


def test_intervals_over_calls_and_the_page(scenario, tmp_path):
    card = _card(tmp_path, scenario, CALLS, 200)
    for source, expected in (("scripted", SCRIPTED), ("simulator", SIMULATOR)):
        for key, value in expected.items():
            got = card["human"]["sources"][source]["metrics"][key]
            assert got["value"] == pytest.approx(value) and got["low"] <= value + 1e-12 <= got["high"] + 2e-12
    # every resample holds some call, and every call has scripted previews; the simulator's are missing on one
    # that only holds call C (probability (1/3)^3 each), so fewer resamples may define them
    assert card["human"]["sources"]["scripted"]["metrics"]["status_agreement"]["resamples"] == 200
    assert card["human"]["sources"]["simulator"]["metrics"]["status_agreement"]["resamples"] <= 200
    # call A alone: scripted status 2/2 and call B alone 0/1, so the interval reaches both ends of [0, 1] as soon
    # as a resample draws A three times and another B three times (each (1/3)^3): near certain in 200
    status = card["human"]["sources"]["scripted"]["metrics"]["status_agreement"]
    assert (status["low"], status["high"]) == (0.0, 1.0)
    card["name"] = "<img src=x onerror=alert(1)>"
    page = render_simulator_page([card])
    assert "Agreement with people" in page and "<img src=x" not in page and "&lt;img src=x" in page


def test_previews_that_do_not_match_the_person_turns_are_refused(scenario, tmp_path):
    bad = json.loads(json.dumps(CALLS))
    bad[0]["previews"] = bad[0]["previews"][:1]  # two person turns, one preview
    with pytest.raises(SystemExit, match="'previews' must hold one entry per person turn \\(2\\), got 1"):
        _card(tmp_path, scenario, bad, 0)


def test_person_turns_count_as_user_turns():
    turns = [TurnRecord.from_dict(t, "t") for t in CALLS[0]["turns"]]
    assert user_turn_count(turns) == 2  # two person turns; the format note is none
