"""bench/learning_stats.py: the one-sided exact sign test and the pairing of validation calls by profile."""
from __future__ import annotations

import random

import pytest

from bench.learning_stats import paired_comparison, sign_test_one_sided


def test_sign_test_matches_hand_computed_values():
    assert sign_test_one_sided(0, 0) == 1.0
    assert sign_test_one_sided(3, 0) == pytest.approx(1 / 8)
    assert sign_test_one_sided(0, 3) == 1.0
    assert sign_test_one_sided(2, 1) == pytest.approx(4 / 8)  # P(X >= 2), X ~ Bin(3, 1/2): (3 + 1) / 8
    assert sign_test_one_sided(14, 2) == pytest.approx((1 + 16 + 120) / 65536)  # C(16,16) + C(16,15) + C(16,14)
    assert sign_test_one_sided(9, 3) == pytest.approx((220 + 66 + 12 + 1) / 4096)
    with pytest.raises(ValueError, match="gained=-1"):
        sign_test_one_sided(-1, 2)


def test_sign_test_is_the_binomial_tail_by_monte_carlo():
    rng = random.Random(0)
    n, observed, draws = 12, 9, 40_000
    tail = sum(sum(rng.random() < 0.5 for _ in range(n)) >= observed for _ in range(draws)) / draws
    assert sign_test_one_sided(observed, n - observed) == pytest.approx(tail, abs=0.006)


def _line(step: int, position: int, profile: dict, outcome: str) -> dict:
    return {"step": step, "split": "val", "uid": f"val{step}_0_{position}", "dialogue_id": f"val{step}_0_{position}#0",
            "profile": profile, "outcome": outcome}


def test_paired_comparison_pairs_calls_by_profile_not_by_order():
    profiles = [{"trust": t, "behaviors": []} for t in range(1, 6)]
    before = ["completed", "hung_up", "hung_up", "timeout", "completed"]
    after = ["completed", "completed", "completed", "hung_up", "hung_up"]
    lines = [_line(0, i, p, o) for i, (p, o) in enumerate(zip(profiles, before))]
    lines += [_line(8, i, p, o) for i, (p, o) in reversed(list(enumerate(zip(profiles, after))))]
    lines.append({**_line(8, 0, profiles[0], "hung_up"), "split": "train"})  # other splits are ignored
    result = paired_comparison(lines, 0, 8)
    assert result == {"n": 5, "completed_before": 2, "completed_after": 3, "gained": 2, "lost": 1,
                      "p_one_sided": pytest.approx(0.5)}


def test_paired_comparison_refuses_validations_of_different_profiles():
    lines = [_line(0, 0, {"trust": 1}, "completed"), _line(8, 0, {"trust": 2}, "completed")]
    with pytest.raises(ValueError, match="did not call the same profiles"):
        paired_comparison(lines, 0, 8)
    with pytest.raises(ValueError, match="share the key"):
        paired_comparison([_line(0, 0, {"trust": 1}, "completed")] * 2, 0, 8)
