"""The scenario YAML's `diagnosis` section: the shipped scenarios' rules, references into the scripted cue lists,
the optional section, and clear errors (file and key path) for every malformed rule."""
from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from llm_agent.scenario import DEFAULT_SCENARIO_PATH, RULE_KINDS, ScenarioError, load_scenario, scenario_path

OUTBOUND = Path(DEFAULT_SCENARIO_PATH)
LABELS = {"doubt_unanswered", "false_claim", "premature_push", "hang_up_after_drop", "format_error", "timeout_loop",
          "truncated"}


@pytest.fixture(scope="module")
def raw_outbound() -> dict:
    data = yaml.safe_load(OUTBOUND.read_text(encoding="utf-8"))
    data["behavior_library"] = str((OUTBOUND.parent / data["behavior_library"]).resolve())
    return data


def _load(tmp_path: Path, data: dict):
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path, load_scenario(path)


@pytest.mark.parametrize("name", ["outbound_ad_trial", "inbound_support"])
def test_shipped_scenarios_bring_a_rule_for_every_label(name):
    scenario = load_scenario(scenario_path(name))
    assert {rule.label for rule in scenario.diagnosis} == LABELS
    assert {rule.kind for rule in scenario.diagnosis} == set(RULE_KINDS)


@pytest.mark.parametrize("name", ["outbound_ad_trial", "inbound_support"])
def test_doubt_cues_recognise_exactly_their_own_scripted_doubts(name):
    """Every scripted user line is recognised as the doubt of its own category and of no other, and no other line
    the scripted user says (greetings, steps done, hang-ups, ...) is taken for a doubt."""
    scenario = load_scenario(scenario_path(name))
    rule = next(r for r in scenario.diagnosis if r.kind == "unanswered_doubt")
    spec = scenario.scripted
    assert {d.category for d in rule.doubts} == set(spec.categories)
    said = [(category, line) for category, script in spec.categories.items() for line in script.doubt]
    said += [(None, line) for lines in spec.lines.values() for line in lines]
    said += [(None, line) for step in spec.steps for line in step.done]
    for category, line in said:
        assert [d.category for d in rule.doubts if d.raised.matches(line)] == ([category] if category else []), line
    for doubt in rule.doubts:  # the answers default to the scripted resolve cues
        assert doubt.answered.sources == spec.categories[doubt.category].resolve.sources


def test_references_splice_the_scripted_cue_lists(tmp_path, raw_outbound):
    data = copy.deepcopy(raw_outbound)
    data["diagnosis"] = {"labels": {"push": {"rule": "premature_push", "push": ["@steps.open_app", "@cues.pushy",
                                                                               "@stage_cues.3", "hurry up"],
                                             "ready": {"cooperation": 2}}}}
    _, scenario = _load(tmp_path, data)
    (rule,) = scenario.diagnosis
    spec = scenario.scripted
    assert rule.cues.sources == (*spec.steps[0].guide.sources, *spec.cues["pushy"].sources,
                                 *spec.stage_cues[3].sources, "hurry up")
    assert rule.ready == {"cooperation": 2}


def test_the_section_is_optional(tmp_path, raw_outbound):
    data = copy.deepcopy(raw_outbound)
    del data["diagnosis"]
    _, scenario = _load(tmp_path, data)
    assert scenario.diagnosis == ()


BAD = [
    ({"labels": {"x": {"rule": "nonsense"}}}, "diagnosis.labels.x.rule", "unknown rule 'nonsense'"),
    ({"labels": {"Bad-Label": {"rule": "truncated"}}}, "diagnosis.labels.Bad-Label", "snake_case"),
    ({"labels": {}}, "diagnosis.labels", "non-empty mapping"),
    ({"labels": {"x": "truncated"}}, "diagnosis.labels.x", "mapping with a 'rule'"),
    ({"labels": {"x": {"rule": "truncated", "window": 2}}}, "diagnosis.labels.x.window", "unknown key"),
    ({"labels": {"x": {"rule": "premature_push", "ready": {"cooperation": 3}}}}, "diagnosis.labels.x.push",
     "missing required key"),
    ({"labels": {"x": {"rule": "premature_push", "push": ["go"], "ready": {"cooperation": 9}}}},
     "diagnosis.labels.x.ready.cooperation", "outside the cooperation range"),
    ({"labels": {"x": {"rule": "premature_push", "push": ["go"], "ready": {}}}}, "diagnosis.labels.x.ready",
     "at least one"),
    ({"labels": {"x": {"rule": "premature_push", "push": ["@steps.nope"], "ready": {"trust": 1}}}},
     "diagnosis.labels.x.push[0]", "unknown reference '@steps.nope'"),
    ({"labels": {"x": {"rule": "false_claim", "claims": ["re:(unclosed"]}}}, "diagnosis.labels.x.claims[0]",
     "bad regex"),
    ({"labels": {"x": {"rule": "false_claim", "claims": ["done ${nobody}"]}}}, "diagnosis.labels.x.claims[0]",
     "unknown placeholder"),
    ({"labels": {"x": {"rule": "drop_before_hang_up", "dimensions": ["mood"]}}}, "diagnosis.labels.x.dimensions",
     "non-empty list"),
    ({"labels": {"x": {"rule": "drop_before_hang_up", "drop": 0}}}, "diagnosis.labels.x.drop", ">= 1"),
    ({"labels": {"x": {"rule": "unanswered_doubt", "doubts": {"made_up": {"raised": ["cost"]}}}}},
     "diagnosis.labels.x.doubts.made_up.answered", "not a scripted category"),
    ({"labels": {"x": {"rule": "unanswered_doubt", "doubts": {"cost_concerns": {"raise": ["cost"]}}}}},
     "diagnosis.labels.x.doubts.cost_concerns.raise", "unknown key"),
    ({"rules": {}}, "diagnosis.labels", "missing required key"),
]


@pytest.mark.parametrize("section,where,reason", BAD, ids=[f"{b[1]}:{b[2]}" for b in BAD])
def test_a_bad_rule_names_the_file_and_key(tmp_path, raw_outbound, section, where, reason):
    data = copy.deepcopy(raw_outbound)
    data["diagnosis"] = section
    with pytest.raises(ScenarioError) as info:
        _load(tmp_path, data)
    assert info.value.where == where, str(info.value)
    assert re.search(re.escape(reason), info.value.reason), str(info.value)
    assert str(tmp_path / "scenario.yaml") in str(info.value)
