"""Is a validation completion-rate gain more than noise? A paired exact test for bench.learning and its test.

Validation calls each fixed test profile with greedy decoding against a seeded simulator, so the calls of two
validations (before and after training) pair up by profile. Only the discordant pairs carry information: a
profile that failed before and completed after ("gained") or the reverse ("lost"). Under the null hypothesis
that training did not make completion more likely (a gained and a lost profile equally likely), `gained` is
Binomial(gained + lost, 1/2); the one-sided exact sign test (McNemar's exact test) gives the probability of at
least the observed `gained`.

The sign test treats the profiles as the only noise. Two runs of the same settings differ as well when their
training is not bitwise reproducible (async rollouts batch the agent's turns as the users' answers arrive), so
settings are compared by whole runs too: `stratified_permutation_test` on a figure per run, several runs per setting.
"""
from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def sign_test_one_sided(gained: int, lost: int) -> float:
    """P(X >= gained) for X ~ Binomial(gained + lost, 1/2): the one-sided exact sign (McNemar) test."""
    if gained < 0 or lost < 0:
        raise ValueError(f"counts must be >= 0, got gained={gained}, lost={lost}")
    n = gained + lost
    return sum(math.comb(n, k) for k in range(gained, n + 1)) / 2 ** n


def _profile_key(line: Mapping[str, Any]) -> str:
    """The identity of a validation call that does not change between validations: its position in the
    validation batch (the uid without its step prefix, and the sample index) and its profile."""
    position = line["uid"].split("_", 1)[1]
    sample = line["dialogue_id"].rsplit("#", 1)[1]
    return f"{position}#{sample}|{json.dumps(line['profile'], sort_keys=True)}"


def val_outcomes(rollouts: Iterable[Mapping[str, Any]], step: int, split: str = "val") -> dict[str, bool]:
    """Per validation call of `step` (keyed by profile and position): whether it completed (`split`: `val`, or
    `val@<judge>` for a second judge's calls).

    ValueError when two calls of the step share a key (the pairing would be ambiguous).
    """
    outcomes: dict[str, bool] = {}
    for line in rollouts:
        if line["split"] != split or line["step"] != step:
            continue
        key = _profile_key(line)
        if key in outcomes:
            raise ValueError(f"validation step {step}: two calls share the key {key!r}")
        outcomes[key] = line["outcome"] == "completed"
    return outcomes


def paired_comparison(rollouts: list[Mapping[str, Any]], before_step: int, after_step: int,
                      split: str = "val") -> dict[str, Any]:
    """Completed calls before and after, the gained / lost profiles and the one-sided sign-test p-value (of the
    validation calls of `split`).

    ValueError when the two validations did not call the same profiles.
    """
    before, after = val_outcomes(rollouts, before_step, split), val_outcomes(rollouts, after_step, split)
    return _paired(before, after, f"validations {before_step} and {after_step}")


def paired_runs(base: list[Mapping[str, Any]], other: list[Mapping[str, Any]], step: int,
                split: str = "val") -> dict[str, Any]:
    """Two runs' validations at `step` (the same fixed profiles), paired by profile: completed in each ("before":
    `base`, "after": `other`), gained / lost from `base` to `other`, the one- and two-sided sign-test p-values.

    ValueError when the two validations did not call the same profiles.
    """
    pair = _paired(val_outcomes(base, step, split), val_outcomes(other, step, split), f"the runs' validations {step}")
    return {**pair, "p_two_sided": sign_test_two_sided(pair["gained"], pair["lost"])}


def sign_test_two_sided(gained: int, lost: int) -> float:
    """The two-sided exact sign test: twice the smaller one-sided tail, at most 1."""
    return min(1.0, 2 * min(sign_test_one_sided(gained, lost), sign_test_one_sided(lost, gained)))


def _paired(before: dict[str, bool], after: dict[str, bool], what: str) -> dict[str, Any]:
    if not before or set(before) != set(after):
        raise ValueError(f"{what} did not call the same profiles "
                         f"({len(before)} and {len(after)} calls, {len(set(before) & set(after))} in common)")
    gained = sum(after[k] and not before[k] for k in before)
    lost = sum(before[k] and not after[k] for k in before)
    return {"n": len(before), "completed_before": sum(before.values()), "completed_after": sum(after.values()),
            "gained": gained, "lost": lost, "p_one_sided": sign_test_one_sided(gained, lost)}


def stratified_permutation_test(strata: Sequence[tuple[Sequence[float], Sequence[float]]],
                                max_arrangements: int = 1_000_000) -> dict[str, Any]:
    """Do whole runs of two settings differ by more than runs of one setting do? An exact permutation test.

    `strata` holds, per stratum (e.g. a seed), the figure of each run of setting A and of setting B (e.g. the last
    validation CR). The statistic is the sum over strata of mean(B) - mean(A); under the null hypothesis that the
    setting does not matter, every split of a stratum's runs into |A| and |B| is equally likely, independently per
    stratum. Returns {"difference": the statistic divided by the number of strata (the mean within-stratum
    difference), "p_two_sided": the share of arrangements whose |statistic| is at least the observed one,
    "arrangements": how many there are}. ValueError on an empty side or more than `max_arrangements`.
    """
    if not strata or any(not a or not b for a, b in strata):
        raise ValueError("stratified_permutation_test: every stratum needs at least one run of each setting")
    arrangements = math.prod(math.comb(len(a) + len(b), len(b)) for a, b in strata)
    if arrangements > max_arrangements:  # refused before anything is enumerated
        raise ValueError(f"stratified_permutation_test: {arrangements} arrangements is over {max_arrangements}")
    per_stratum = []
    observed = 0.0
    for a, b in strata:
        runs = [float(x) for x in (*a, *b)]
        if not all(math.isfinite(x) for x in runs):
            raise ValueError(f"stratified_permutation_test: non-finite figure in {runs}")
        observed += statistics.fmean(b) - statistics.fmean(a)
        total = sum(runs)
        # every choice of which runs are B's gives mean(B) - mean(A) from the sum of the chosen runs
        per_stratum.append([s / len(b) - (total - s) / len(a)
                            for s in map(sum, itertools.combinations(runs, len(b)))])
    sums = [0.0]
    for differences in per_stratum:
        sums = [s + d for s in sums for d in differences]
    extreme = sum(abs(s) >= abs(observed) - 1e-9 for s in sums)
    return {"difference": observed / len(strata), "p_two_sided": extreme / arrangements, "arrangements": arrangements}
