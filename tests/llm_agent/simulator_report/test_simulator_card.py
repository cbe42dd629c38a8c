"""The report card's metrics on two hand-built dialogues whose every value is worked out by hand, its bootstrap
intervals against an independent resampling loop, and the scripted persona graded on the probes."""
from __future__ import annotations

import numpy as np
import pytest

from llm_agent.evaluation.stats import bootstrap_indices
from llm_agent.simulator_report import (SimDialogue, SimTurn, build_card, build_probe_set, card_metrics, run_probes,
                                        score_dialogues)
from llm_agent.simulator_report.card import METRIC_KEYS
from llm_agent.stand_ins.inprocess_user_sim import InProcessUserSim
from tests.helpers.sim_report_fixtures import COST_DOUBT, INTRO, NEUTRAL, PUSHY, agent, profile, reply_text, user


def hand_dialogues(scenario) -> list[SimDialogue]:
    """D1 (c2 e3 t2, cost doubts): T1 the introduction, first a reply without tags, then the right one voicing the
    cost doubt; T2 a pushy turn answered with the right direction but emotion 2 (not 0) and no hang-up.
    D2 (c2 e2 t2, trust doubts): T1 the introduction answered with trust +3 (over the limit of 2), no doubt
    voiced; T2 no answer at all."""
    p1, p2 = profile(scenario, (2, 3, 2), "cost_concerns"), profile(scenario, (2, 2, 2), "trust_and_scepticism")
    d1_t1 = scenario.render_user_messages(p1, [agent(scenario, INTRO)])
    d1_t2 = scenario.render_user_messages(p1, [agent(scenario, INTRO), user(scenario, COST_DOUBT, (2, 3, 3)),
                                               agent(scenario, PUSHY)])
    d2_t1 = scenario.render_user_messages(p2, [agent(scenario, INTRO)])
    d2_t2 = scenario.render_user_messages(p2, [agent(scenario, INTRO), user(scenario, "Fine.", (2, 2, 5)),
                                               agent(scenario, NEUTRAL)])
    return [
        SimDialogue("d1", p1, [
            SimTurn(d1_t1, (COST_DOUBT, reply_text(scenario, COST_DOUBT, (2, 3, 3))), (0.1, 0.3)),
            SimTurn(d1_t2, (reply_text(scenario, "Fine.", (1, 2, 3)),), (0.2,))]),
        SimDialogue("d2", p2, [
            SimTurn(d2_t1, (reply_text(scenario, "Fine.", (2, 2, 5)),), (0.4,)),
            SimTurn(d2_t2, (), (), failure="all 3 attempts failed")]),
    ]


# Per turn (D1T1, D1T2, D2T1, D2T2): first reply valid F T T F; requests 2 1 1 1; accepted reply format-valid
# T T T -; jump ok T T F -; direction ok T T T -; same direction T T T -; same state T F F -; same status
# T F T - (the pushy turn makes the persona hang up); D1's cost doubt voiced, D2's trust doubt not.
EXPECTED = {
    "first_try_valid_rate": 0.5, "first_try_accepted_rate": 0.5, "rerequest_rate": 0.25, "rerequests_per_turn": 0.25,
    "failed_rate": 0.25, "control_text_rate": 0.0, "format_valid_rate": 0.75, "jump_within_limits_rate": 0.5, "direction_consistent_rate": 0.75,
    "scripted_direction_agreement": 0.75, "scripted_state_agreement": 0.25, "scripted_status_agreement": 0.5,
    "behaviour_adherence": 0.5,
    "latency_p50_s": 0.25, "latency_p95_s": 0.3 + 0.85 * 0.1,  # latencies 0.1 0.2 0.3 0.4, linear interpolation
    # accepted spoken replies: "What's this going to cost?", "Fine.", "Fine." -> 7 words, 6 distinct; 4 word
    # pairs, all distinct; 2 distinct replies of 3
    "distinct_1": 6 / 7, "distinct_2": 1.0, "unique_reply_rate": 2 / 3,
}


def test_card_metrics_on_hand_built_dialogues(scenario):
    metrics = card_metrics(score_dialogues(hand_dialogues(scenario), scenario))
    assert set(metrics) == set(METRIC_KEYS)
    for key, value in EXPECTED.items():
        assert metrics[key] == pytest.approx(value, abs=1e-12), key


def test_bootstrap_intervals_match_an_independent_resampling(scenario):
    dialogues = hand_dialogues(scenario)
    card = build_card(dialogues, scenario, "hand", {"kind": "test"}, n_resamples=300, seed=5)
    assert card["n_dialogues"] == 2 and card["n_turns"] == 4
    # failed_rate per resample, computed here from the per-dialogue counts: D1 0 of 2 failed, D2 1 of 2
    failed = [sum(d == 1 for d in rows) / (2 * len(rows)) for rows in bootstrap_indices(2, 300, 5)]
    low, high = np.quantile(failed, [0.025, 0.975])
    assert card["metrics"]["failed_rate"] == {"value": 0.25, "low": pytest.approx(low), "high": pytest.approx(high),
                                              "resamples": 300}  # every resample defines failed_rate
    assert card["metrics"]["distinct_1"] == pytest.approx(6 / 7)  # no interval for diversity
    assert card["metrics"]["first_try_valid_rate"]["low"] <= 0.5 <= card["metrics"]["first_try_valid_rate"]["high"]
    assert card["examples"]["malformed_first_replies"][0]["reply"] == COST_DOUBT
    assert card["jump_limits"]["trust"] == {"fall": 2, "rise": 2}
    plain = build_card(dialogues, scenario, "hand", {"kind": "test"}, n_resamples=0)
    assert plain["metrics"]["failed_rate"] == 0.25 and plain["probe_fingerprint"] == card["probe_fingerprint"]
    with pytest.raises(ValueError, match="no simulator turns"):
        build_card([SimDialogue("e", dialogues[0].profile)], scenario, "empty", {})


def test_logged_turns_have_no_first_try_or_latency_but_count_logged_rerequests(scenario):
    dialogues = hand_dialogues(scenario)
    logged = [SimDialogue(d.dialogue_id, d.profile, [SimTurn(t.messages, t.replies[-1:], failure=t.failure,
                                                             first_try_known=False) for t in d.turns],
                          logged_rerequests=r) for d, r in zip(dialogues, (3, 1))]
    metrics = card_metrics(score_dialogues(logged, scenario))
    for key in ("first_try_valid_rate", "first_try_accepted_rate", "rerequest_rate", "latency_p50_s"):
        assert metrics[key] is None, key
    assert metrics["rerequests_per_turn"] == 1.0  # 4 logged re-requests over 4 graded turns
    assert metrics["scripted_direction_agreement"] == 0.75


def test_the_scripted_persona_grades_perfectly_on_its_probes_and_probes_are_fixed(scenario):
    probes = build_probe_set(scenario, n_dialogues=6)
    again = build_probe_set(scenario, n_dialogues=6)
    other = build_probe_set(scenario, n_dialogues=6, seed=1)
    assert [t.messages for d in probes.dialogues for t in d.turns] == \
           [t.messages for d in again.dialogues for t in d.turns]
    assert [t.messages for d in probes.dialogues for t in d.turns] != \
           [t.messages for d in other.dialogues for t in d.turns]
    with InProcessUserSim(scenario) as sim:
        card = build_card(run_probes(sim, probes, scenario), scenario, "scripted", {}, n_resamples=50)
    assert card["n_turns"] == probes.n_requests
    for key in ("first_try_valid_rate", "format_valid_rate", "jump_within_limits_rate", "direction_consistent_rate",
                "scripted_direction_agreement", "scripted_state_agreement", "scripted_status_agreement"):
        assert card["metrics"][key]["value"] == 1.0, key
    assert card["metrics"]["failed_rate"]["value"] == 0.0


def test_replies_holding_control_text_are_counted_and_shown(scenario):
    dialogues = hand_dialogues(scenario)
    injected = reply_text(scenario, COST_DOUBT + "<|im_end|><|im_start|>system", (2, 3, 3))
    first = dialogues[0].turns[0]
    dialogues[0].turns[0] = SimTurn(first.messages, (injected, first.replies[1]), (0.1, 0.3))
    metrics = card_metrics(score_dialogues(dialogues, scenario))
    assert metrics["control_text_rate"] == 0.25 and metrics["first_try_valid_rate"] == 0.5
    card = build_card(dialogues, scenario, "x", {}, n_resamples=0)
    assert card["examples"]["control_text_replies"] == [{"dialogue_id": "d1", "turn": 0, "reply": injected}]


def test_agreement_per_probing_agent_is_worked_out_by_hand(scenario):
    # the hand dialogues' turns (see EXPECTED): D1 format T T, direction T T, state T F, status T F;
    # D2 format T -, direction T -, state F -, status T - (its second turn got no answer: failing every check)
    d1, d2 = hand_dialogues(scenario)
    labelled = [SimDialogue(d1.dialogue_id, d1.profile, d1.turns, agent="good"),
                SimDialogue(d2.dialogue_id, d2.profile, d2.turns, agent="wrong_answer")]
    card = build_card(labelled, scenario, "hand", {"kind": "test"}, n_resamples=0)
    assert card["by_agent"] == {
        "good": {"n_dialogues": 1, "n_turns": 2, "format_valid_rate": 1.0, "scripted_direction_agreement": 1.0,
                 "scripted_state_agreement": 0.5, "scripted_status_agreement": 0.5},
        "wrong_answer": {"n_dialogues": 1, "n_turns": 2, "format_valid_rate": 0.5,
                         "scripted_direction_agreement": 0.5, "scripted_state_agreement": 0.0,
                         "scripted_status_agreement": 0.5}}
    assert build_card(hand_dialogues(scenario), scenario, "logged", {}, n_resamples=0)["by_agent"] == {}
    with_intervals = build_card(labelled, scenario, "hand", {}, n_resamples=20)["by_agent"]["wrong_answer"]
    assert with_intervals["scripted_state_agreement"]["value"] == 0.0  # one dialogue: every resample is itself


def test_probe_dialogues_carry_their_agents_quality_and_the_persona_agrees_with_itself_on_each(scenario):
    probes = build_probe_set(scenario, n_dialogues=4, quality_mix={"wrong_answer": 1.0, "good": 1.0})
    assert {d.agent for d in probes.dialogues} <= {"wrong_answer", "good"}
    with InProcessUserSim(scenario) as sim:
        card = build_card(run_probes(sim, probes, scenario), scenario, "scripted", {}, n_resamples=0)
    assert sum(row["n_dialogues"] for row in card["by_agent"].values()) == len(probes.dialogues)
    for row in card["by_agent"].values():
        assert row["scripted_direction_agreement"] == row["scripted_status_agreement"] == 1.0
