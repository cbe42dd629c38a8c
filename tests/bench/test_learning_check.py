"""bench/learning_check.py: the independent replay of the controller rule agrees with StateController and
catches a weight that moved otherwise."""
from __future__ import annotations

import random

import pytest

from bench.learning_check import controller_check, controller_table, valid_values
from llm_agent.controller import ControllerConfig, StateController
from llm_agent.scenario import DEFAULT_SCENARIO_PATH, load_scenario

SCENARIO = DEFAULT_SCENARIO_PATH


def _run(config: ControllerConfig, steps: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Drive a real controller with random outcomes (easy states complete more); return the trainer-style
    per-step metrics and rollout-log lines."""
    scenario = load_scenario(SCENARIO)
    controller = StateController(config, scenario)
    rng = random.Random(seed)
    train_steps, rollouts = [], []
    for step in range(1, steps + 1):
        outcomes = []
        for profile in controller.sample(24):
            p = (profile.state["cooperation"] + profile.state["trust"]) / 8 * rng.choice([0.3, 1.0, 1.6])
            outcome = "completed" if rng.random() < p else rng.choice(["hung_up", "timeout", "error"])
            key = scenario.state_key(profile.state)
            rollouts.append({"step": step, "split": "train", "state_key": key, "outcome": outcome})
            if outcome != "error":
                outcomes.append((key, outcome == "completed"))
        metrics = controller.update(outcomes)
        train_steps.append({"step": step, "controller": {k.split("/", 1)[1]: v for k, v in metrics.items()}})
    return train_steps, rollouts


@pytest.mark.parametrize("max_ratio, floor", [(4.0, 0.02), (1.3, 0.2)])  # the second makes the bound bind
def test_replay_matches_the_controller_and_flags_a_tampered_weight(max_ratio, floor):
    config = ControllerConfig(max_ratio=max_ratio, floor=floor, smoothing=0.7)
    train_steps, rollouts = _run(config, steps=6, seed=3)
    settings = {k: getattr(config, k) for k in ("target_completion_rate", "dead_band", "smoothing", "floor",
                                                "max_ratio")}
    check = controller_check(train_steps, rollouts, valid_values(SCENARIO), settings)
    assert len(check["steps"]) == 6 and check["max_abs_diff"] < 1e-9
    modes = {row["mode"] for row in check["steps"]}
    assert modes <= {"toward easy", "toward hard", "dead band"} and modes
    assert "match the independent" in controller_table(check)
    first = check["steps"][0]
    assert sum(n for _, n in first["dims"]["cooperation"]["completed_count"]) == first["n"]

    train_steps[3]["controller"]["weight/trust=2"] += 0.01
    tampered = controller_check(train_steps, rollouts, valid_values(SCENARIO), settings)
    assert tampered["steps"][3]["dims"]["trust"]["max_abs_diff"] == pytest.approx(0.01, abs=1e-9)
    assert "DO NOT match" in controller_table(tampered)
