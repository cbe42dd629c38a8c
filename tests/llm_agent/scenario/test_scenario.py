"""Scenario loading, validation errors and prompt rendering (llm_agent/scenario/scenario.py)."""
from __future__ import annotations

import copy
import pickle
import random
import re
from pathlib import Path

import pytest
import yaml

from llm_agent.scenario import (DEFAULT_SCENARIO_PATH, AgentTurn, Behavior, ScenarioError, UserProfile, UserTurn,
                                load_behavior_library, load_scenario, sample_behaviors, scenario_path)
from tests.helpers.profiles import DIMS, profile3

ROOT = Path(__file__).resolve().parents[3]
OUTBOUND = DEFAULT_SCENARIO_PATH
INBOUND = scenario_path("inbound_support")
LIBRARY = ROOT / "assets/client_action.jsonl"
SCENARIOS = [OUTBOUND, INBOUND]
CATEGORIES = {"identity_verification", "trust_and_scepticism", "cost_concerns", "rule_understanding",
              "suitability_doubts", "information_confirmation", "operational_concerns", "communication",
              "comparison", "testing", "past_experience", "boundary_testing", "expediting", "detail_fixation"}


def _profile(scenario, seed: int) -> UserProfile:
    rng = random.Random(seed)
    state = rng.choice(scenario.state_space())
    return profile3(*state, behaviors=tuple(sample_behaviors(scenario.behaviors, rng)))


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_shipped_scenarios_load_and_render(path):
    sc = load_scenario(path)
    assert sc.name == path.stem
    assert [sc.state_ranges[d].max for d in DIMS] == [4, 3, 5]
    assert sc.stage_ids == (0, 1, 2, 3)
    assert len(sc.scripted.steps) == 2
    assert {b.category for b in sc.behaviors} <= set(sc.scripted.categories)
    prompt = sc.render_agent_prompt()
    assert "${" not in prompt and "- -" not in prompt
    for stage in sc.stages:
        assert stage.name in prompt and stage.goal in prompt
    for fact in sc.facts:
        assert f"- {fact}" in prompt
    for tag in sc.agent_tags.tags.values():
        assert f"<{tag}>" in prompt and f"</{tag}>" in prompt
    for seed in range(5):
        profile = _profile(sc, seed)
        persona = sc.render_user_prompt(profile)
        assert "${" not in persona and "- -" not in persona
        assert all(f"\n- {b.behavior}\n" in persona for b in profile.behaviors)
        assert f"cooperation {profile.state['cooperation']} " in persona
        for tag in sc.user_tags.tags.values():
            assert f"<{tag}>" in persona


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_scripted_lines_survive_the_tag_protocol(path):
    """Every canned user line, written with format_user_output, parses back unchanged and well formed."""
    sc = load_scenario(path)
    spec = sc.scripted
    lines = [*(x for v in spec.lines.values() for x in v), *(x for s in spec.steps for x in s.done),
             *(x for c in spec.categories.values() for x in c.doubt)]
    state = {"cooperation": 2, "emotion": 1, "trust": 3}
    for line in lines:
        assert "${" not in line
        turn = sc.parse_user_output(sc.format_user_output(line, state, 0))
        assert turn.reply == line and turn.well_formed, (line, turn.flags)


def test_behavior_library_covers_all_categories():
    lib = load_behavior_library(LIBRARY, CATEGORIES)
    assert 90 <= len(lib) <= 110
    assert {b.category for b in lib} == CATEGORIES
    assert len({b.behavior for b in lib}) == len(lib)
    sc = load_scenario(OUTBOUND)
    assert set(sc.scripted.categories) == CATEGORIES
    assert tuple(lib) == sc.behaviors


def test_scenario_pickles_for_ray_workers():
    sc = load_scenario(OUTBOUND)
    clone = pickle.loads(pickle.dumps(sc))
    assert clone.render_agent_prompt() == sc.render_agent_prompt()
    assert clone.scripted.cues["empathy"].matches("No worries, take your time.")
    assert clone.parse_user_output("<user_reply>ok</user_reply>").reply == "ok"


def test_empty_behaviors_render_the_scenario_text():
    sc = load_scenario(OUTBOUND)
    persona = sc.render_user_prompt(profile3(2, 1, 3))
    assert sc.no_behaviors in persona and "${" not in persona


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_recover_profile_inverts_render(path):
    sc = load_scenario(path)
    for seed in range(20):
        profile = _profile(sc, seed)
        assert sc.recover_profile(sc.render_user_prompt(profile)) == profile
    assert sc.recover_profile(sc.render_user_prompt(profile3(0, 0, 0))) == profile3(0, 0, 0)
    multiline = profile3(1, 2, 3, (Behavior("cost_concerns", "Asks about\n  fees twice."),))
    assert sc.recover_profile(sc.render_user_prompt(multiline)).behaviors[0].behavior == "Asks about fees twice."
    stranger = profile3(1, 1, 1, (Behavior("cost_concerns", "Asks about parking."),))
    got = sc.recover_profile(sc.render_user_prompt(stranger))
    assert got.behaviors == (Behavior("unknown", "Asks about parking."),)
    with pytest.raises(ValueError, match="not a persona"):
        sc.recover_profile("You are a pirate.")


def test_user_messages_carry_spoken_words_only():
    sc = load_scenario(OUTBOUND)
    profile = _profile(sc, 3)
    agent_text = ("<think>they sound busy</think><cooperation_score>2</cooperation_score>"
                  "<emotion_score>1</emotion_score><trust_score>3</trust_score><stage>1</stage>"
                  "<response>Hi, this is Mia from FoodLoop. <user_status>1</user_status>Got a minute?</response>"
                  "<status>0</status>")
    a1 = sc.parse_agent_output(agent_text)
    assert "tags_in_reply" in a1.flags
    u1 = sc.parse_user_output("<user_think>who?</user_think><user_reply>Who is this?</user_reply>"
                              "<user_cooperation>2</user_cooperation><user_emotion>1</user_emotion>"
                              "<user_trust>2</user_trust><user_status>0</user_status>")
    a2 = sc.parse_agent_output("<stage>0</stage><status>0</status>")  # no reply at all
    msgs = sc.render_user_messages(profile, [a1, u1, a2])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[0]["content"] == sc.render_user_prompt(profile)
    assert msgs[1]["content"] == "Hi, this is Mia from FoodLoop. Got a minute?"
    assert msgs[3]["content"] == sc.silent_agent
    hidden = [*sc.agent_tags.tags.values(), "user_status"]
    for m in (msgs[1], msgs[3]):
        assert not any(re.search(rf"</?{t}>", m["content"]) for t in hidden)
        assert "they sound busy" not in m["content"]
    own = msgs[2]["content"]
    assert "<user_cooperation>2</user_cooperation>" in own and "<user_trust>2</user_trust>" in own
    assert "<user_reply>Who is this?</user_reply>" in own and "<user_status>0</user_status>" in own
    assert "user_think" not in own
    with pytest.raises(ValueError, match="ends with an agent turn"):
        sc.render_user_messages(profile, [a1, u1])
    with pytest.raises(ValueError):
        sc.render_user_messages(profile, [])
    with pytest.raises(ValueError, match="outside"):
        sc.render_user_messages(profile3(9, 0, 0), [a1])


def test_agent_messages_hide_user_state():
    sc = load_scenario(INBOUND)
    a1 = sc.parse_agent_output(sc.format_agent_output("Hi, Brightcart support, Sam here.", 0, 0,
                                                      {"cooperation": 2, "emotion": 1, "trust": 2}))
    u1 = sc.parse_user_output(sc.format_user_output("My refund!", {"cooperation": 1, "emotion": 0, "trust": 1}, 0))
    msgs = sc.render_agent_messages([a1, u1])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[1]["content"] == sc.agent_opening
    assert msgs[2]["content"] == a1.raw
    assert msgs[3]["content"] == "My refund!"
    with pytest.raises(TypeError):
        sc.render_agent_messages(["hello"])


def test_profile_roundtrip_and_state_key():
    b = (Behavior("cost_concerns", "Asks about fees."),)
    p = profile3(2, 1, 3, b)
    assert UserProfile.from_dict(p.to_dict()) == p
    sc = load_scenario(OUTBOUND)
    assert sc.state_key(p.state) == "c2-e1-t3" == sc.state_key((2, 1, 3))
    assert sc.state_schema.parse_key("c2-e1-t3") == (2, 1, 3) and sc.profile((2, 1, 3), b) == p
    assert p.to_dict() == {"cooperation": 2, "emotion": 1, "trust": 3,
                           "behaviors": [{"category": "cost_concerns", "behavior": "Asks about fees."}]}
    with pytest.raises(ValueError, match=r"missing \['trust'\]"):
        sc.check_profile(UserProfile.from_dict({"cooperation": 1, "emotion": 1}))
    with pytest.raises(ValueError, match=r"unknown \['mood'\]"):
        sc.check_profile(UserProfile.from_dict({"cooperation": 1, "emotion": 1, "trust": 1, "mood": 2}))
    for bad in ("c2-e1", "c2-e1-t3x", "e1-c2-t3", None):
        with pytest.raises(ValueError, match="bad state_key"):
            sc.state_schema.parse_key(bad)
    with pytest.raises(ValueError, match=r"behaviors\[0\]"):
        UserProfile.from_dict({"cooperation": 1, "emotion": 1, "trust": 1, "behaviors": [{"category": "x"}]})
    with pytest.raises(ValueError, match="int"):
        profile3(1.5, 1, 1)
    with pytest.raises(ValueError, match="emotion=7"):
        load_scenario(OUTBOUND).check_profile(profile3(1, 7, 1))


def test_sample_behaviors_is_seeded_and_distinct():
    lib = load_behavior_library(LIBRARY)
    draws = [sample_behaviors(lib, random.Random(7)) for _ in range(2)]
    assert draws[0] == draws[1]
    counts = set()
    for seed in range(50):
        got = sample_behaviors(lib, random.Random(seed), 1, 3)
        assert len(set(got)) == len(got)
        counts.add(len(got))
    assert counts == {1, 2, 3}


# ------------------------------------------------------------------ bad scenario files
def _write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


@pytest.fixture
def raw_outbound() -> dict:
    data = yaml.safe_load(OUTBOUND.read_text(encoding="utf-8"))
    data["behavior_library"] = str(LIBRARY)
    return data


def _mutate(raw: dict, dotted: str, value):
    data = copy.deepcopy(raw)
    node = data
    keys = dotted.split(".")
    for key in keys[:-1]:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is _DELETE:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return data


_DELETE = object()
BAD_CASES = [
    ("agent.opening", _DELETE, "agent.opening", "missing required key"),
    ("state.trust", {"min": 3, "max": 3}, "state.trust", "below max"),
    ("state.emotion.max", "three", "state.emotion.max", "integer"),
    ("user.persona", "Hi ${cooperation} ${emotion} ${trust} ${behaviors} ${output_format} ${budget}",
     "user.persona", r"unknown placeholder \$\{budget\}"),
    ("user.persona", "Hi ${cooperation} ${emotion} ${behaviors} ${output_format}", "user.persona",
     r"missing required placeholder \$\{trust\}"),
    ("user.persona", "Hi ${cooperation} ${emotion} ${trust}\n- ${behaviors}\n${output_format}", "user.persona",
     "bullets"),
    ("agent.system_prompt", "${stages} ${facts} ${output_format} ${ oops}", "agent.system_prompt", "malformed"),
    ("scripted.lines.greeting", ["Hello ${nobody}"], r"scripted.lines.greeting[0]", "unknown placeholder"),
    ("agent.colour", "blue", "agent.colour", "unknown key"),
    ("scripted.rules.doubt_patiance", 2, "scripted.rules.doubt_patiance", "unknown key .did you mean 'doubt_patience'"),
    ("scripted.cues.pushy", ["re:(unclosed"], "scripted.cues.pushy[0]", "bad regex"),
    ("scripted.stage_cues", {0: ["a"], 1: ["b"]}, "scripted.stage_cues", "stage ids"),
    ("scripted.rules.act_min_cooperation", 9, "scripted.rules.act_min_cooperation", "outside"),
    ("scripted.effects.teleport", {"trust": 1}, "scripted.effects.teleport", "unknown key"),
    ("scripted.rules.max_words", 0, "scripted.rules.max_words", ">= 1"),
    ("scripted.rules.act_min_trust", 6, "scripted.rules.act_min_trust", "outside the trust range"),
    ("scripted.rules.max_topics", "many", "scripted.rules.max_topics", "integer"),
    ("scripted.lines.overloaded", [], "scripted.lines.overloaded", "non-empty list"),
    ("agent.tags.stage.tag", "response", "agent.tags.reply.tag", "used twice"),
    ("vars.stages", "x", "vars.stages", "dynamic placeholder"),
    ("stages.1.id", 0, "stages[1].id", "distinct"),
    ("behavior_library", "nope.jsonl", "behavior_library", "no such file"),
]


@pytest.mark.parametrize("dotted,value,where,reason", BAD_CASES, ids=[c[0] + ":" + c[3] for c in BAD_CASES])
def test_bad_scenario_names_file_and_key(tmp_path, raw_outbound, dotted, value, where, reason):
    path = _write(tmp_path, _mutate(raw_outbound, dotted, value))
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    err = info.value
    assert err.file == str(path) and err.where == where, str(err)
    assert re.search(reason, err.reason), str(err)
    assert str(path) in str(err) and where in str(err)


def test_anti_stuffing_rules_and_overloaded_lines_are_optional(tmp_path, raw_outbound):
    data = raw_outbound
    for key in ("rules.max_words", "rules.max_topics", "rules.act_min_trust", "lines.overloaded"):
        data = _mutate(data, f"scripted.{key}", _DELETE)
    spec = load_scenario(_write(tmp_path, data)).scripted
    assert (spec.rules.max_words, spec.rules.max_topics, spec.rules.act_min) == (60, 8, {"cooperation": 3})
    assert spec.lines["overloaded"] == spec.lines["confused"]
    shipped = load_scenario(OUTBOUND).scripted
    assert shipped.lines["overloaded"] != shipped.lines["confused"]


def test_empty_or_non_mapping_file(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("", encoding="utf-8")
    with pytest.raises(ScenarioError, match="top level.*mapping"):
        load_scenario(path)


def test_yaml_syntax_error_names_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\ndescription: fine\nstate: {cooperation: [1, 2\nstages: []\n", encoding="utf-8")
    with pytest.raises(ScenarioError, match="YAML syntax error") as info:
        load_scenario(path)
    assert info.value.file == str(path) and info.value.where.startswith("line ")


def test_missing_file_and_both_behaviour_sources(tmp_path, raw_outbound):
    with pytest.raises(ScenarioError, match="cannot read"):
        load_scenario(tmp_path / "absent.yaml")
    data = dict(raw_outbound, behaviors=[{"category": "cost_concerns", "behavior": "x"}])
    with pytest.raises(ScenarioError, match="exactly one"):
        load_scenario(_write(tmp_path, data))
    data = {k: v for k, v in raw_outbound.items() if k != "behavior_library"}
    data["behaviors"] = [{"category": "cost_concerns", "behavior": "ok"}, {"category": "weather", "behavior": "x"}]
    with pytest.raises(ScenarioError) as info:
        load_scenario(_write(tmp_path, data))
    assert info.value.where == "behaviors[1]" and "weather" in info.value.reason


LIB_CASES = [
    ('{"category": "cost_concerns", "behavior": "ok"}\n{"category": "cost_concerns", "behavior": \n', 2, "JSON"),
    ('{"category": "cost_concerns", "behavior": "ok"}\n\n{"category": "cost_concerns"}\n', 3, "behavior"),
    ('{"category": "cost_concerns", "behavior": "ok", "weight": 2}\n', 1, "unknown"),
    ('["cost_concerns", "ok"]\n', 1, "object"),
    ('{"category": "Cost Concerns", "behavior": "ok"}\n', 1, "snake_case"),
    ('{"category": "weather", "behavior": "ok"}\n', 1, "scripted.categories"),
    ('{"category": "cost_concerns", "behavior": "   "}\n', 1, "non-empty"),
]


@pytest.mark.parametrize("text,line,reason", LIB_CASES)
def test_bad_library_line_names_file_and_line(tmp_path, text, line, reason):
    path = tmp_path / "lib.jsonl"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ScenarioError) as info:
        load_behavior_library(path, CATEGORIES)
    assert info.value.file == str(path) and info.value.where == f"line {line}"
    assert reason in info.value.reason
    assert f"{path}: line {line}:" in str(info.value)


def test_bad_library_referenced_by_scenario_reports_library_line(tmp_path, raw_outbound):
    lib = tmp_path / "lib.jsonl"
    lib.write_text('{"category": "cost_concerns", "behavior": "ok"}\n{"category": "nope", "behavior": "x"}\n')
    raw_outbound["behavior_library"] = "lib.jsonl"
    with pytest.raises(ScenarioError) as info:
        load_scenario(_write(tmp_path, raw_outbound))
    assert info.value.file == str(lib.resolve()) and info.value.where == "line 2"
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ScenarioError, match="empty"):
        load_behavior_library(empty)


def test_new_scenario_with_other_tags_needs_no_code(tmp_path):
    """A scenario with renamed tags, other vars and literal dollars works through the same code."""
    data = yaml.safe_load(INBOUND.read_text(encoding="utf-8"))
    data["name"] = "renamed_tags"
    data["vars"]["shop"] = "Parcelo"
    data["facts"].append("Express shipping costs $5 (write $$ for a literal dollar: $${x}).")
    data["user"]["tags"]["reply"]["tag"] = "say"
    data["user"]["tags"]["status"]["tag"] = "done"
    data["agent"]["tags"]["reply"]["tag"] = "speak"
    data["agent"]["tags"]["think"] = {"tag": "plan", "about": "your private plan"}
    sc = load_scenario(_write(tmp_path, data))
    prompt = sc.render_agent_prompt()
    assert "Parcelo" in prompt and "Brightcart" not in prompt
    assert "costs $5 (write $ for a literal dollar: ${x})." in prompt
    assert "<plan>...</plan>" in prompt and "<speak>...</speak>" in prompt
    turn = sc.parse_user_output("<say>Fine.</say><user_cooperation>3</user_cooperation><done>1</done>")
    assert (turn.reply, turn.status, turn.state["cooperation"]) == ("Fine.", 1, 3)
    agent = sc.parse_agent_output("<plan>calm them</plan><speak>Sorry about that.</speak><status>0</status>")
    assert (agent.reply, agent.think, agent.status) == ("Sorry about that.", "calm them", 0)
    msgs = sc.render_user_messages(profile3(2, 1, 2), [agent])
    assert msgs[-1] == {"role": "user", "content": "Sorry about that."}
    assert isinstance(turn, UserTurn) and isinstance(agent, AgentTurn)
