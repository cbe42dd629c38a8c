"""bench/learning_stats.py: the one-sided exact sign test, the pairing of validation calls by profile and the
permutation test between runs."""
from __future__ import annotations

import itertools
import math
import random
from fractions import Fraction

import pytest

from bench.learning_stats import paired_comparison, sign_test_one_sided, stratified_permutation_test


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


def test_permutation_test_matches_a_hand_enumerated_stratum():
    # the 6 ways to pick B's two runs of (1, 2, 3, 4): mean(B) - mean(A) = 2, 1, 0, 0, -1, -2; |d| >= 2 twice
    result = stratified_permutation_test([([1, 2], [3, 4])])
    assert result == {"difference": 2.0, "p_two_sided": pytest.approx(2 / 6), "arrangements": 6}
    # two strata: 6 x 6 arrangements; only the two where both strata split as observed (or both reversed) reach 4
    result = stratified_permutation_test([([1, 2], [3, 4]), ([10, 20], [30, 40])])
    assert result["difference"] == pytest.approx((2 + 20) / 2) and result["arrangements"] == 36
    assert result["p_two_sided"] == pytest.approx(2 / 36)


def _brute_force(strata: list[tuple[list[int], list[int]]]) -> Fraction:
    """Every ordering of each stratum's runs (the first len(A) are A's), exact fractions: the two-sided p."""
    def stat(split: list[tuple[tuple[int, ...], int]]) -> Fraction:
        return sum((Fraction(sum(runs[n_a:]), len(runs) - n_a) - Fraction(sum(runs[:n_a]), n_a) for runs, n_a in split),
                   Fraction(0))
    observed = stat([((*a, *b), len(a)) for a, b in strata])
    orderings = [list(itertools.permutations((*a, *b))) for a, b in strata]
    total = extreme = 0
    for choice in itertools.product(*orderings):
        total += 1
        extreme += abs(stat([(runs, len(a)) for runs, (a, _) in zip(choice, strata)])) >= abs(observed)
    return Fraction(extreme, total)


def test_permutation_test_equals_brute_force_over_every_ordering_on_random_strata():
    rng = random.Random(7)
    for _ in range(25):
        strata = [([rng.randrange(40, 64) for _ in range(rng.randint(1, 3))],
                   [rng.randrange(40, 64) for _ in range(rng.randint(1, 3))]) for _ in range(rng.randint(1, 2))]
        result = stratified_permutation_test([([x / 64 for x in a], [x / 64 for x in b]) for a, b in strata])
        assert result["p_two_sided"] == pytest.approx(float(_brute_force(strata)), abs=1e-12)
        assert result["arrangements"] == math.prod(math.comb(len(a) + len(b), len(b)) for a, b in strata)


def test_permutation_test_refuses_what_it_cannot_test():
    for strata, match in [([], "at least one run"), ([([0.5], [])], "at least one run"),
                          ([([0.5, float("nan")], [0.6])], "non-finite"),
                          ([([0.1] * 8, [0.2] * 8)] * 2, "arrangements is over"),
                          ([([0.1] * 20, [0.2] * 20)], "137846528820 arrangements")]:  # C(40, 20): never enumerated
        with pytest.raises(ValueError, match=match):
            stratified_permutation_test(strata)
