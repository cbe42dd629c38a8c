"""Bootstrap intervals, pairing and McNemar's exact test against hand-computed values and independent loops."""
from __future__ import annotations

import itertools
import math
import random

import pytest

from llm_agent.evaluation.stats import (Interval, bootstrap_indices, mcnemar_exact, metric_intervals, pair_records,
                                        paired_comparison)

from tests.helpers.eval_fixtures import linear_percentile
from tests.helpers.eval_fixtures import typed_record as record


def test_point_values_on_a_hand_computed_fixture(scenario):
    records = [record("completed", 2, 0), record("completed", 4, 1), record("timeout", 5, 2), record("error", 1, 3)]
    got = metric_intervals(records, scenario, n_resamples=50, seed=0)
    assert got["completion_rate"].value == pytest.approx(2 / 3)
    assert got["att"].value == pytest.approx(3.0)
    assert got["adt"].value == pytest.approx(11 / 3)
    assert got["error_rate"].value == pytest.approx(0.25)
    assert got["n_dialogues"].value == 4.0
    for interval in got.values():
        assert interval.low <= interval.high if interval.defined else interval.low is None
    # no turn holds states or a claim: UPA and FPR are undefined, with no interval
    assert got["upa"] == got["false_positive_rate"] == Interval(None, None, None, 0)


def test_resamples_where_a_metric_is_undefined_are_skipped_and_counted(scenario):
    # two completed calls among 14: about (12/14)^14 = 12% of resamples draw no completed call, so ATT is
    # undefined there; the interval is over the others, computed here by an independent loop
    records = [record("completed", 3, 0), record("completed", 6, 1)] + [record("hung_up", 2 + i % 4, i)
                                                                         for i in range(2, 14)]
    got = metric_intervals(records, scenario, n_resamples=400, seed=2)
    atts = []
    for rows in bootstrap_indices(len(records), 400, 2):
        done = [records[i].num_turns for i in rows if records[i].outcome == "completed"]
        if done:
            atts.append(sum(done) / len(done))
    assert 300 < len(atts) < 390
    att = got["att"]
    assert (att.value, att.resamples) == (4.5, len(atts))
    assert att.low == pytest.approx(linear_percentile(atts, 0.025), abs=1e-12) and att.low == 3.0
    assert att.high == pytest.approx(linear_percentile(atts, 0.975), abs=1e-12) and att.high == 6.0
    assert got["completion_rate"].resamples == 400
    assert got["att"].to_dict() == {"value": 4.5, "low": att.low, "high": att.high, "resamples": len(atts)}


def test_two_dialogues_give_the_hand_computed_percentile_interval(scenario):
    # Resampling [completed, hung_up]: CR is 0, 1/2, 1 with probability 1/4, 1/2, 1/4, so the 2.5% and 97.5%
    # quantiles of many resamples are exactly 0 and 1.
    got = metric_intervals([record("completed", 2, 0), record("hung_up", 3, 1)], scenario, n_resamples=4000)
    cr = got["completion_rate"]
    assert (cr.value, cr.low, cr.high) == (0.5, 0.0, 1.0)
    assert (got["adt"].low, got["adt"].high) == (2.0, 3.0)


def test_all_equal_dialogues_give_a_point_interval(scenario):
    got = metric_intervals([record("completed", 4, i) for i in range(5)], scenario, n_resamples=200)
    assert (got["completion_rate"].low, got["completion_rate"].high) == (1.0, 1.0)
    assert (got["att"].value, got["att"].low, got["att"].high) == (4.0, 4.0, 4.0)


def test_intervals_are_the_percentiles_of_an_independent_resampling_loop(scenario):
    rng = random.Random(7)
    outcomes = [rng.choice(["completed", "hung_up", "timeout", "error"]) for _ in range(30)]
    turns = [rng.randint(1, 8) for _ in outcomes]
    records = [record(o, t, i) for i, (o, t) in enumerate(zip(outcomes, turns))]
    got = metric_intervals(records, scenario, n_resamples=300, confidence=0.9, seed=3)
    crs, adts = [], []
    for rows in bootstrap_indices(len(records), 300, 3):
        kept = [i for i in rows if outcomes[i] != "error"]
        crs.append(sum(outcomes[i] == "completed" for i in kept) / len(kept) if kept else 0.0)
        adts.append(sum(float(turns[i]) for i in kept) / len(kept) if kept else 0.0)
    assert got["completion_rate"].low == pytest.approx(linear_percentile(crs, 0.05), abs=1e-12)
    assert got["completion_rate"].high == pytest.approx(linear_percentile(crs, 0.95), abs=1e-12)
    assert got["adt"].low == pytest.approx(linear_percentile(adts, 0.05), abs=1e-12)
    assert got["adt"].high == pytest.approx(linear_percentile(adts, 0.95), abs=1e-12)


def test_cr_interval_agrees_with_the_normal_approximation(scenario):
    records = [record("completed" if i < 120 else "hung_up", 3, i) for i in range(400)]
    cr = metric_intervals(records, scenario, n_resamples=1000, seed=1)["completion_rate"]
    half = 1.96 * math.sqrt(0.3 * 0.7 / 400)  # 0.0449
    assert cr.value == pytest.approx(0.3)
    assert cr.low == pytest.approx(0.3 - half, abs=0.012) and cr.high == pytest.approx(0.3 + half, abs=0.012)


def test_bootstrap_indices_are_seeded_and_in_range():
    a, b = bootstrap_indices(7, 50, 11), bootstrap_indices(7, 50, 11)
    assert a.shape == (50, 7) and (a == b).all() and a.min() >= 0 and a.max() <= 6
    assert not (bootstrap_indices(7, 50, 12) == a).all()
    with pytest.raises(ValueError, match="at least one dialogue"):
        bootstrap_indices(0, 10, 0)


@pytest.mark.parametrize("b, c, expected", [(1, 5, 14 / 64), (0, 6, 2 / 64), (3, 3, 1.0), (0, 0, 1.0),
                                            (12, 0, 2 / 4096), (2, 8, 2 * 56 / 1024)])
def test_mcnemar_exact_on_hand_computed_values(b, c, expected):
    assert mcnemar_exact(b, c) == pytest.approx(expected, abs=1e-15)


def test_mcnemar_exact_matches_enumerating_every_sign_pattern():
    # Under H0 each discordant pair is A-only or B-only with probability 1/2: enumerate all 2^n patterns and
    # count those at least as far from n/2 as the observed split.
    for n in range(1, 13):
        for b in range(n + 1):
            extreme = sum(1 for pattern in itertools.product((0, 1), repeat=n)
                          if abs(sum(pattern) - n / 2) >= abs(b - n / 2))
            assert mcnemar_exact(b, n - b) == pytest.approx(extreme / 2 ** n, abs=1e-12), (b, n - b)


def test_pairing_needs_the_same_dialogue_and_profile():
    a = [record("completed", 2, i) for i in range(3)]
    b = [record("hung_up", 2, 0), record("hung_up", 2, 1, profile=(1, 1, 1)), record("hung_up", 2, 5)]
    pairs = pair_records(a, b)
    assert [(x.dialogue_id, y.dialogue_id) for x, y in pairs] == [("test0#0", "test0#0")]
    with pytest.raises(ValueError, match="occurs twice"):
        pair_records(a + [record("timeout", 1, 0)], b)


def test_paired_comparison_on_a_hand_computed_fixture(scenario):
    a_done, b_done = set(range(6)), {0, 1, 6}  # only A: 2,3,4,5 (b = 4); only B: 6 (c = 1)
    a = [record("completed" if i in a_done else "hung_up", 3, i) for i in range(10)]
    b = [record("completed" if i in b_done else "timeout", 3, i) for i in range(10)]
    got = paired_comparison(a, b, scenario, n_resamples=400, seed=5)
    assert got.n_pairs == 10 and (got.only_a_completed, got.only_b_completed) == (4, 1)
    assert got.mcnemar_p == pytest.approx(2 * (1 + 5) / 32)
    assert got.cr_difference.value == pytest.approx(0.6 - 0.3)
    diffs = [sum((i in a_done) - (i in b_done) for i in rows) / 10 for rows in bootstrap_indices(10, 400, 5)]
    assert got.cr_difference.low == pytest.approx(linear_percentile(diffs, 0.025), abs=1e-12)
    assert got.cr_difference.high == pytest.approx(linear_percentile(diffs, 0.975), abs=1e-12)


def test_mcnemar_leaves_out_pairs_with_an_error_dialogue(scenario):
    a = [record("completed", 3, 0), record("completed", 3, 1), record("error", 1, 2)]
    b = [record("hung_up", 3, 0), record("error", 1, 1), record("completed", 3, 2)]
    got = paired_comparison(a, b, scenario, n_resamples=20)
    assert got.n_pairs == 3 and got.mcnemar_pairs == 1 and (got.only_a_completed, got.only_b_completed) == (1, 0)
    assert paired_comparison(a, [record("completed", 3, 9)], scenario, n_resamples=20) is None
