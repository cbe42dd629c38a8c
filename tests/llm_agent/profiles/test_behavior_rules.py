"""The rule table: which behaviour categories contradict which states, checked against hand-written cases."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from llm_agent.profiles.rules import DEFAULT_RULES_PATH, load_rule_table, state_levels
from llm_agent.scenario import DEFAULT_SCENARIO_PATH, Behavior, load_scenario, scenario_path
from tests.helpers.profiles import profile3

REPO = Path(__file__).resolve().parents[3]
SCENARIO = load_scenario(DEFAULT_SCENARIO_PATH)
RANGES = SCENARIO.state_ranges  # cooperation 0-4, emotion 0-3, trust 0-5


def _b(category: str) -> Behavior:
    return next(b for b in SCENARIO.behaviors if b.category == category)


# (cooperation, emotion, trust), category, contradicts? -- worked out by hand from the YAML's levels
CASES = [
    ((2, 1, 4), "trust_and_scepticism", True),    # trust 4/5 = 0.8 >= 0.6
    ((2, 1, 3), "trust_and_scepticism", True),    # 0.6 exactly
    ((2, 1, 2), "trust_and_scepticism", False),   # 0.4
    ((2, 1, 4), "identity_verification", True),   # 0.8
    ((2, 1, 3), "identity_verification", False),
    ((2, 2, 3), "past_experience", True),         # trust 0.6 and emotion 2/3 = 0.67
    ((2, 1, 4), "past_experience", False),        # emotion 0.33
    ((3, 1, 1), "suitability_doubts", True),      # cooperation 0.75
    ((2, 3, 5), "suitability_doubts", False),
    ((3, 2, 1), "communication", True),           # emotion 0.67 and cooperation 0.75
    ((3, 1, 1), "communication", False),
    ((1, 2, 3), "testing", True),                 # cooperation 0.25
    ((1, 2, 3), "boundary_testing", True),
    ((2, 2, 3), "boundary_testing", False),
    ((2, 2, 1), "expediting", True),              # trust 0.2
    ((1, 2, 4), "expediting", True),              # cooperation 0.25
    ((2, 2, 2), "expediting", False),
    ((0, 0, 0), "cost_concerns", False),
    ((4, 3, 5), "comparison", False),
]


@pytest.mark.parametrize("state, category, contradicts", CASES)
def test_hand_worked_cases(state, category, contradicts):
    table = load_rule_table()
    profile = profile3(*state, behaviors=(_b(category),))
    assert bool(table.violations(profile, RANGES)) is contradicts
    assert (_b(category) in table.allowed(SCENARIO.behaviors, state, RANGES)) is (not contradicts)


def test_levels_are_positions_in_the_range():
    assert state_levels((1, 2, 4), RANGES) == pytest.approx({"cooperation": 0.25, "emotion": 2 / 3, "trust": 0.8})


def test_every_library_category_of_both_scenarios_has_a_rule_with_a_reason():
    table = load_rule_table()
    library = {json.loads(line)["category"] for line in (REPO / "assets/client_action.jsonl").read_text().splitlines()
               if line.strip()}
    other = load_scenario(scenario_path("inbound_support"))
    assert library | {b.category for b in other.behaviors} <= set(table.rules)
    assert all(len(table.reasons[c]) > 20 for c in table.rules)


def test_rule_sampling_never_violates_and_is_seeded():
    table = load_rule_table()
    rng = random.Random(3)
    for _ in range(300):
        state = tuple(rng.randint(RANGES[d].min, RANGES[d].max) for d in ("cooperation", "emotion", "trust"))
        drawn = table.sample(SCENARIO.behaviors, state, RANGES, random.Random(7), 1, 3)
        assert 1 <= len(drawn) <= 3 and len(set(drawn)) == len(drawn)
        assert not table.violations(profile3(*state, behaviors=tuple(drawn)), RANGES)
        assert drawn == table.sample(SCENARIO.behaviors, state, RANGES, random.Random(7), 1, 3)


@pytest.mark.parametrize("text, match", [
    ("categories: {a: {why: x}}", "exactly the keys 'why' and 'contradicts'"),
    ("categories: {a: {why: '', contradicts: []}}", r"categories\.a\.why"),
    ("categories: {a: {why: w, contradicts: [{trust: [0.8, 0.2]}]}}", r"contradicts\[0\]\.trust.*low <= high"),
    ("categories: {a: {why: w, contradicts: [[0, 1]]}}", r"contradicts\[0\]: must map"),
    ("categories: {a: {why: w, contradicts: [{trust: 1}]}}", r"must be \[low, high\]"),
    ("nothing: here", "'categories' mapping"),
])
def test_bad_tables_name_file_and_key(tmp_path, text, match):
    path = tmp_path / "rules.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        load_rule_table(path)
    assert str(path) in str(info.value)


def test_a_library_category_without_rule_is_an_error(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text("categories: {cost_concerns: {why: any state, contradicts: []}}")
    with pytest.raises(ValueError, match=r"categories \['boundary_testing', 'communication', 'comparison'"):
        load_rule_table(path).check_library(SCENARIO.behaviors)
    assert DEFAULT_RULES_PATH.is_file()


def test_a_rule_on_a_dimension_the_scenario_lacks_is_an_error(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text("categories: {cost_concerns: {why: w, contradicts: [{mood: [0, 1]}]}}")
    table = load_rule_table(path)  # a table serves several scenarios: its dimensions are checked per scenario
    library = [b for b in SCENARIO.behaviors if b.category == "cost_concerns"]
    table.check_library(library)
    with pytest.raises(ValueError, match=r"categories.cost_concerns names dimension\(s\) \['mood'\].*"
                                         r"\['cooperation', 'emotion', 'trust'\]"):
        table.check_library(library, "scenario outbound_ad_trial", SCENARIO.dims)
