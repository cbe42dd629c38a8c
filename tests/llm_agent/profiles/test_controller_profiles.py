"""The state controller's profile_source: uniform, the rule filter online, or a pool written ahead."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from llm_agent.controller import ControllerConfig, StateController
from llm_agent.profiles.rules import load_rule_table
from llm_agent.scenario import DEFAULT_SCENARIO_PATH, load_scenario
from tests.helpers.profiles import profile3

REPO = Path(__file__).resolve().parents[3]
SCENARIO = load_scenario(DEFAULT_SCENARIO_PATH)
RULES = load_rule_table()


def share_violating(profiles):
    return sum(bool(RULES.violations(p, SCENARIO.state_ranges)) for p in profiles) / len(profiles)


def test_rules_source_never_violates_while_uniform_does():
    uniform = StateController(ControllerConfig(profile_source="uniform", seed=1), SCENARIO).sample(400)
    rules = StateController(ControllerConfig(profile_source="rules", seed=1), SCENARIO).sample(400)
    assert share_violating(rules) == 0.0
    assert share_violating(uniform) > 0.1  # the library's uniform draw does contradict states
    assert all(1 <= len(p.behaviors) <= 3 and set(p.behaviors) <= set(SCENARIO.behaviors) for p in rules)


def test_pool_source_draws_written_profiles_of_the_sampled_state(tmp_path):
    # Two written profiles for state c2-e1-t2, one for c1-e1-t1; every other state falls back to the rules.
    lib = SCENARIO.behaviors
    written = [profile3(2, 1, 2, (lib[0],)), profile3(2, 1, 2, (lib[30], lib[31])),
               profile3(1, 1, 1, (lib[50],))]
    path = tmp_path / "pool.jsonl"
    path.write_text("".join(json.dumps({"index": i, "source": "llm", "profile": p.to_dict()}) + "\n"
                            for i, p in enumerate(written)))
    ctl = StateController(ControllerConfig(profile_source="pool", pool_path=str(path), seed=3), SCENARIO)
    ctl.set_weights({"cooperation": {"1": 0.5, "2": 0.5, "3": 0.0}, "emotion": {"1": 1.0, "2": 0.0},
                     "trust": {"1": 0.5, "2": 0.5, "3": 0.0, "4": 0.0}})
    drawn = ctl.sample(400)
    by_state = Counter(SCENARIO.state_key(p.state) for p in drawn)
    hits = [p for p in drawn if p in written]
    pooled_states = {"c2-e1-t2", "c1-e1-t1"}
    assert {SCENARIO.state_key(p.state) for p in hits} == pooled_states
    assert len(hits) == sum(by_state[k] for k in pooled_states)  # a pooled state always gets a written profile
    assert Counter(p for p in hits if SCENARIO.state_key(p.state) == "c2-e1-t2").keys() == set(written[:2])
    misses = [p for p in drawn if SCENARIO.state_key(p.state) not in pooled_states]
    assert misses and share_violating(misses) == 0.0  # the fallback is the rule filter
    assert ctl.metrics()["controller/pool_miss_rate"] == pytest.approx(len(misses) / 400)
    state = ctl.state_dict()
    again = StateController(ControllerConfig(profile_source="pool", pool_path=str(path), seed=3), SCENARIO)
    again.load_state_dict(json.loads(json.dumps(state)))
    assert again.sample(50) == ctl.sample(50)


@pytest.mark.parametrize("kwargs, match", [
    ({"profile_source": "llm"}, r"controller\.profile_source='llm' must be one of \['uniform', 'rules', 'pool'\]"),
    ({"profile_source": "pool"}, r"controller\.pool_path=None must name the profiles file"),
    ({"rules_path": 3}, r"controller\.rules_path must be a string, got 3"),
])
def test_bad_profile_source_settings_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ControllerConfig.from_dict(kwargs)


def test_pool_with_a_behaviour_outside_the_library_names_file_and_line(tmp_path):
    path = tmp_path / "pool.jsonl"
    good = profile3(2, 1, 2, (SCENARIO.behaviors[0],)).to_dict()
    bad = {**good, "behaviors": [{"category": "cost_concerns", "behavior": "Asks for a free car."}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=r"pool\.jsonl:2: bad profile: behaviour\(s\) not in the library"):
        StateController(ControllerConfig(profile_source="pool", pool_path=str(path)), SCENARIO)


def test_set_weights_checks_labels():
    ctl = StateController(ControllerConfig(), SCENARIO)
    with pytest.raises(ValueError, match=r"weights\.emotion must give a weight to exactly \['1', '2'\]"):
        ctl.set_weights({"cooperation": {"1": 1, "2": 1, "3": 1}, "emotion": {"1": 1},
                         "trust": {"1": 1, "2": 1, "3": 1, "4": 1}})
