"""StateController: the SEAD re-weighting rule against independent plain-Python computations, sampling, state."""
from __future__ import annotations

import itertools
import json
import logging
import random

import pytest

from llm_agent.controller import ControllerConfig, StateController, bound_weights

from tests.helpers.profiles import DIMS

VALID = {"cooperation": [1, 2, 3], "emotion": [1, 2], "trust": [1, 2, 3, 4]}  # the scenario's ranges minus extremes


# ------------------------------------------------------------------ independent reference implementation
def ref_bound(weights: list[float], floor: float, ratio: float) -> list[float]:
    """Clip up to max(floor, max/ratio) and renormalise until nothing moves (the documented iteration)."""
    w = [x / sum(weights) for x in weights]
    for _ in range(100_000):
        lo = max(floor, max(w) / ratio)
        clipped = [max(x, lo) for x in w]
        new = [x / sum(clipped) for x in clipped]
        if max(abs(a - b) for a, b in zip(new, w)) < 1e-15:
            return new
        w = new
    raise AssertionError("reference iteration did not converge")


def ref_update(old: dict[str, list[float]], values: dict[str, list], outcomes, cfg: ControllerConfig,
               key_of) -> dict[str, list[float]]:
    """One update by hand: CR, deviation, per-value sr/count, the §9.2 rule, EMA, then floor and ratio."""
    n = len(outcomes)
    cr = sum(1.0 for _, done in outcomes if done) / n
    d = cr - cfg.target_completion_rate
    new = {}
    for group, vals in values.items():
        raw = []
        for v in vals:
            hits = [done for key, done in outcomes if key_of(group, key) == v]
            count = len(hits)
            sr = sum(hits) / count if count else 0.5
            count = count or 1
            if d < -cfg.dead_band:
                raw.append(1 + 2 * abs(d) * sr)
            elif d > cfg.dead_band:
                raw.append(1 + 2 * d * (1 - sr))
            else:
                raw.append(1 + 0.1 / count)
        target = [x / sum(raw) for x in raw]
        mixed = [(1 - cfg.smoothing) * o + cfg.smoothing * t for o, t in zip(old[group], target)]
        new[group] = ref_bound(mixed, cfg.floor, cfg.max_ratio)
    return new


def per_dim_key(group: str, key: str) -> int:
    c, e, t = (int(part[1:]) for part in key.split("-"))
    return {"cooperation": c, "emotion": e, "trust": t}[group]


def weights_list(ctrl: StateController) -> dict[str, list[float]]:
    return {g: list(w.values()) for g, w in ctrl.weights.items()}


def random_outcomes(seed: int, n: int, p_of) -> list[tuple[str, bool]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        c, e, t = (rng.choice(VALID[d]) for d in DIMS)
        out.append((f"c{c}-e{e}-t{t}", rng.random() < p_of(c, e, t)))
    return out


# ------------------------------------------------------------------------------------ the update rule
@pytest.mark.parametrize("p_scale, cfg_kwargs", [
    (1.0, {}),                                                 # CR above target
    (0.15, {}),                                                # CR below target
    (0.55, {"dead_band": 0.3}),                                # inside the dead band
    (1.0, {"smoothing": 1.0, "max_ratio": 1.1}),               # the ratio binds
    (1.2, {"smoothing": 1.0, "floor": 0.24, "max_ratio": 50.0}),  # the floor binds
])
def test_two_updates_match_reference(scenario, p_scale, cfg_kwargs):
    cfg = ControllerConfig(**cfg_kwargs)
    ctrl = StateController(cfg, scenario)
    expected = {g: [1 / len(v)] * len(v) for g, v in VALID.items()}
    for group in VALID:
        assert weights_list(ctrl)[group] == pytest.approx(expected[group])
    for step in range(2):
        outcomes = random_outcomes(step, 200, lambda c, e, t: p_scale * (0.2 * c + 0.1 * t))
        expected = ref_update(expected, VALID, outcomes, cfg, per_dim_key)
        ctrl.update(outcomes)
        got = weights_list(ctrl)
        for group in VALID:
            assert got[group] == pytest.approx(expected[group], abs=1e-12), (step, group)
            assert sum(got[group]) == pytest.approx(1.0, abs=1e-12)
            assert min(got[group]) >= cfg.floor - 1e-12
            assert max(got[group]) / min(got[group]) <= cfg.max_ratio + 1e-9


def test_floor_and_ratio_actually_bind_in_reference_cases(scenario):
    cfg = ControllerConfig(smoothing=1.0, floor=0.24, max_ratio=50.0)
    ctrl = StateController(cfg, scenario)
    ctrl.update([("c1-e1-t1", True)] * 50 + [("c3-e2-t4", False)] * 5)  # CR 0.91: unbounded trust=1 is 0.18
    assert min(ctrl.weights["trust"].values()) == pytest.approx(0.24)
    cfg = ControllerConfig(smoothing=1.0, max_ratio=1.1)
    ctrl = StateController(cfg, scenario)
    ctrl.update([("c1-e1-t1", True)] * 50 + [("c3-e2-t4", False)] * 5)
    w = ctrl.weights["cooperation"]
    assert max(w.values()) / min(w.values()) == pytest.approx(1.1)


def test_bound_weights_matches_iteration_on_random_vectors():
    rng = random.Random(3)
    for _ in range(300):
        n = rng.randint(1, 30)
        w = [rng.random() ** 4 + 1e-6 for _ in range(n)]
        floor = rng.choice([0.0, rng.uniform(0, 1 / n)])
        ratio = rng.choice([float("inf"), rng.uniform(1, 20)])
        got = bound_weights(w, floor, ratio)
        assert got == pytest.approx(ref_bound(w, floor, ratio), abs=1e-10)
        assert sorted(range(n), key=lambda i: (got[i], w[i])) == sorted(range(n), key=lambda i: w[i])
    with pytest.raises(ValueError, match="exceeds 1"):
        bound_weights([1.0, 2.0, 3.0], 0.4, 4.0)


def test_above_target_moves_mass_to_hard_values_below_target_to_easy(scenario):
    def run(sr_c1: float, sr_c3: float) -> dict[str, float]:
        ctrl = StateController(ControllerConfig(), scenario)
        outcomes = [(f"c1-e1-t{i % 4 + 1}", i % 10 < 10 * sr_c1) for i in range(100)]
        outcomes += [(f"c3-e2-t{i % 4 + 1}", i % 10 < 10 * sr_c3) for i in range(100)]
        ctrl.update(outcomes)
        return ctrl.metrics()

    high = run(0.4, 1.0)  # CR 0.7 > 0.6: lower sr gains; unseen cooperation 2 counts as sr 0.5
    assert (high["controller/cr"], high["controller/cr/cooperation=1"]) == (0.7, 0.4)
    w = [high[f"controller/weight/cooperation={v}"] for v in (1, 2, 3)]
    assert w[0] > w[1] > 1 / 3 > w[2]
    low = run(0.0, 0.6)  # CR 0.3 < 0.4: higher sr gains
    assert low["controller/cr"] == 0.3
    w = [low[f"controller/weight/cooperation={v}"] for v in (1, 2, 3)]
    assert w[2] > w[1] > 1 / 3 > w[0]


def test_dead_band_ignores_success_rates(scenario):
    ctrl = StateController(ControllerConfig(dead_band=0.1), scenario)
    outcomes = [("c1-e1-t1", False)] * 10 + [("c2-e1-t2", True)] * 10 + [("c3-e2-t3", True)] * 5 \
        + [("c3-e2-t4", False)] * 5  # CR 0.5: inside the band despite sr 0 vs 1
    ctrl.update(outcomes)
    coop = ctrl.weights["cooperation"]
    assert coop["1"] == pytest.approx(coop["2"]) == pytest.approx(coop["3"])
    trust = ctrl.weights["trust"]  # counts 10, 10, 5, 5: the rarer values get 1 + 0.1/count, slightly more
    assert trust["3"] == pytest.approx(trust["4"]) and trust["1"] == pytest.approx(trust["2"])
    assert trust["3"] > trust["1"]


@pytest.mark.parametrize("c1_done, c3_done", [(2, 0), (4, 2)])
def test_deviation_equal_to_dead_band_is_inside_it(scenario, c1_done, c3_done):
    ctrl = StateController(ControllerConfig(dead_band=0.25, smoothing=1.0), scenario)
    outcomes = [("c1-e1-t1", i < c1_done) for i in range(4)] + [("c3-e1-t1", i < c3_done) for i in range(4)]
    m = ctrl.update(outcomes)  # CR 0.25 or 0.75: |d| == dead_band exactly
    assert abs(m["controller/deviation"]) == 0.25
    assert m["controller/cr/cooperation=1"] != m["controller/cr/cooperation=3"]
    coop = ctrl.weights["cooperation"]  # counts 4, unseen (1), 4 -> 1.025, 1.1, 1.025
    assert [coop["1"], coop["2"], coop["3"]] == pytest.approx([1.025 / 3.15, 1.1 / 3.15, 1.025 / 3.15])


def test_empty_update_changes_nothing(scenario):
    ctrl = StateController(ControllerConfig(), scenario)
    ctrl.update([("c1-e1-t1", True)] * 8)
    before, metrics = ctrl.state_dict(), ctrl.metrics()
    assert ctrl.update([]) == metrics
    assert ctrl.state_dict() == before


def test_update_logs_weights(scenario, caplog):
    ctrl = StateController(ControllerConfig(), scenario)
    with caplog.at_level(logging.INFO, logger="llm_agent.controller"):
        ctrl.update([("c1-e1-t1", True), ("c2-e1-t1", False)])
    assert any("weights" in r.getMessage() and "cooperation" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("allow_extremes", [False, True])
def test_sampled_profiles_in_range_with_valid_behaviours(scenario, allow_extremes):
    cfg = ControllerConfig(allow_extremes=allow_extremes, min_behaviors=2, max_behaviors=4, seed=5)
    profiles = StateController(cfg, scenario).sample(3000)
    assert len(profiles) == 3000
    library = set(scenario.behaviors)
    for dim in DIMS:
        rng = scenario.state_ranges[dim]
        want = set(range(rng.min, rng.max + 1)) if allow_extremes else set(VALID[dim])
        assert {p.state[dim] for p in profiles} == want
    counts = set()
    for p in profiles:
        scenario.check_profile(p)
        assert 2 <= len(p.behaviors) <= 4 and set(p.behaviors) <= library
        assert len(set(p.behaviors)) == len(p.behaviors)
        counts.add(len(p.behaviors))
    assert counts == {2, 3, 4}
    assert StateController(ControllerConfig(min_behaviors=0, max_behaviors=0), scenario).sample(5)[0].behaviors == ()


def chi_square(observed: dict, probs: dict, n: int) -> float:
    return sum((observed.get(k, 0) - n * p) ** 2 / (n * p) for k, p in probs.items())


def test_sampling_frequencies_match_weights(scenario):
    ctrl = StateController(ControllerConfig(smoothing=1.0, seed=11), scenario)
    ctrl.update([("c1-e1-t1", False)] * 30 + [("c3-e2-t4", True)] * 70 + [("c2-e1-t2", True)] * 20)
    n = 20000
    profiles = ctrl.sample(n)
    for dim in DIMS:
        probs = ctrl.weights[dim]
        assert max(probs.values()) > 1.2 * min(probs.values())  # a non-uniform target
        observed = {}
        for p in profiles:
            observed[str(p.state[dim])] = observed.get(str(p.state[dim]), 0) + 1
        assert chi_square(observed, probs, n) < 20.0  # df <= 3: p(chi2 > 16.3) = 0.001


# ----------------------------------------------------------------------------------------- joint mode
def test_joint_mode_update_and_sampling(scenario):
    cfg = ControllerConfig(joint=True, smoothing=0.7, seed=2)
    ctrl = StateController(cfg, scenario)
    combos = [f"c{c}-e{e}-t{t}" for c, e, t in itertools.product(*(VALID[d] for d in DIMS))]
    assert list(ctrl.weights["joint"]) == combos
    expected = {"joint": [1 / 24] * 24}
    for step in range(2):
        outcomes = random_outcomes(10 + step, 300, lambda c, e, t: 0.25 * c * (e == 2) + 0.05 * t)
        expected = ref_update(expected, {"joint": combos}, outcomes, cfg, lambda g, key: key)
        ctrl.update(outcomes)
        assert list(ctrl.weights["joint"].values()) == pytest.approx(expected["joint"], abs=1e-12)
    metrics = ctrl.metrics()
    for i, dim in enumerate(DIMS):
        for v in VALID[dim]:
            marginal = sum(w for k, w in zip(combos, expected["joint"]) if int(k.split("-")[i][1:]) == v)
            assert metrics[f"controller/weight/{dim}={v}"] == pytest.approx(marginal, abs=1e-12)
    n = 24000
    observed = {}
    for p in ctrl.sample(n):
        key = "c{cooperation}-e{emotion}-t{trust}".format(**p.state)
        observed[key] = observed.get(key, 0) + 1
    assert chi_square(observed, ctrl.weights["joint"], n) < 60.0  # df 23: p(chi2 > 49.7) = 0.001


# ------------------------------------------------------------------------------------ metrics & state
def test_metrics_report_last_update(scenario):
    ctrl = StateController(ControllerConfig(), scenario)
    assert ctrl.metrics()["controller/updates"] == 0.0 and "controller/cr" not in ctrl.metrics()
    m = ctrl.update([("c1-e1-t1", True), ("c1-e2-t1", False), ("c3-e2-t4", True), ("c2-e1-t2", False)])
    assert m["controller/cr"] == 0.5 and m["controller/n"] == 4.0 and m["controller/updates"] == 1.0
    assert m["controller/cr/cooperation=1"] == 0.5 and m["controller/cr/emotion=2"] == 0.5
    assert m["controller/cr/trust=4"] == 1.0 and "controller/cr/cooperation=0" not in m
    for dim in DIMS:
        assert sum(m[f"controller/weight/{dim}={v}"] for v in VALID[dim]) == pytest.approx(1.0)


@pytest.mark.parametrize("joint", [False, True])
def test_state_round_trip_restores_weights_and_rng(scenario, joint):
    cfg = ControllerConfig(joint=joint, seed=9)
    ctrl = StateController(cfg, scenario)
    ctrl.sample(17)
    ctrl.update(random_outcomes(4, 100, lambda c, e, t: 0.3 * c / 3 + 0.1 * e))
    saved = json.loads(json.dumps(ctrl.state_dict()))
    restored = StateController(ControllerConfig(joint=joint, seed=123), scenario)
    restored.load_state_dict(saved)
    assert restored.weights == ctrl.weights and restored.metrics() == ctrl.metrics()
    assert restored.sample(50) == ctrl.sample(50)
    outcomes = random_outcomes(5, 80, lambda c, e, t: 0.9)
    assert restored.update(outcomes) == ctrl.update(outcomes)
    with pytest.raises(ValueError, match="labels"):
        StateController(ControllerConfig(joint=not joint), scenario).load_state_dict(saved)
    with pytest.raises(ValueError, match="missing key"):
        restored.load_state_dict({k: v for k, v in saved.items() if k != "rng"})
    group = "joint" if joint else "trust"
    with pytest.raises(ValueError, match=f"'weights.{group}' must be"):
        restored.load_state_dict({**saved, "weights": {**saved["weights"], group: [0.5]}})
    assert restored.weights == ctrl.weights  # a rejected state changes nothing


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("d, match", [
    ({"flor": 0.1}, r"controller\.flor is not a config key \(did you mean controller\.floor\?\)"),
    ({"target_completion_rate": 1.5}, r"controller\.target_completion_rate=1.5 is outside \[0, 1\]"),
    ({"max_ratio": 0.5}, r"controller\.max_ratio=0.5 is outside \[1, inf\)"),
    ({"smoothing": 0}, r"controller\.smoothing=0.0 is outside \(0, 1\]"),
    ({"floor": "1e-2"}, r"controller\.floor must be a number, got '1e-2'"),
    ({"joint": "yes"}, r"controller\.joint must be true or false"),
    ({"seed": 1.5}, r"controller\.seed must be an integer"),
    ({"min_behaviors": 3, "max_behaviors": 2}, r"controller\.max_behaviors=2 must be >= controller\.min_behaviors \(3\)"),
])
def test_bad_config_values_are_named(d, match):
    with pytest.raises(ValueError, match=match):
        ControllerConfig.from_dict(d, "controller")


def test_scenario_dependent_config_errors(scenario):
    assert ControllerConfig.from_dict(None) == ControllerConfig()
    with pytest.raises(ValueError, match=r"floor=0.3 times 4 valid values of trust is 1.2 > 1"):
        StateController(ControllerConfig(floor=0.3), scenario)
    with pytest.raises(ValueError, match=r"24 valid values of joint"):
        StateController(ControllerConfig(floor=0.05, joint=True), scenario)
    with pytest.raises(ValueError, match="min_behaviors=500 exceeds the 99 behaviours"):
        StateController(ControllerConfig(min_behaviors=500, max_behaviors=500), scenario)


@pytest.mark.parametrize("outcome, match", [
    (("c2-e1", True), r"outcomes\[1\]: bad state_key 'c2-e1'"),
    (("c2-e1-t3x", True), r"outcomes\[1\]: bad state_key"),
    ((None, True), r"outcomes\[1\]: bad state_key None"),
    (("c9-e1-t1", True), r"outcomes\[1\]: state_key 'c9-e1-t1' has cooperation=9 outside \[0, 4\]"),
    (("c2-e1-t1", "completed"), r"outcomes\[1\]: completed must be a bool"),
    (("c2-e1-t1",), r"outcomes\[1\] must be a \(state_key, completed\) pair"),
])
def test_bad_outcomes_are_named_and_change_nothing(scenario, outcome, match):
    ctrl = StateController(ControllerConfig(), scenario)
    before = ctrl.state_dict()
    with pytest.raises(ValueError, match=match):
        ctrl.update([("c1-e1-t1", True), outcome])
    assert ctrl.state_dict() == before
