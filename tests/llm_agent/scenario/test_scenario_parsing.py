"""Tag parsing, formatting, cue matching and templates (llm_agent/scenario/scenario.py, scenario_parse.py)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from llm_agent.scenario import DEFAULT_SCENARIO_PATH, CueList, load_scenario
from llm_agent.scenario.tags import TemplateError, any_tag_re, placeholders, substitute

ROOT = Path(__file__).resolve().parents[3]
SC = load_scenario(DEFAULT_SCENARIO_PATH)
PROTOCOL = any_tag_re([*SC.agent_tags.tags.values(), *SC.user_tags.tags.values()])

GOOD_AGENT = ("<cooperation_score>2</cooperation_score><emotion_score>1</emotion_score><trust_score>3</trust_score>"
              "<stage>1</stage><response>It's free, nothing to pay.</response><status>0</status>")
GOOD_USER = ("<user_think>hmm</user_think><user_reply>Okay, go on.</user_reply><user_cooperation>3</user_cooperation>"
             "<user_emotion>2</user_emotion><user_trust>4</user_trust><user_status>0</user_status>")


def test_well_formed_turns_parse_without_flags():
    a = SC.parse_agent_output(GOOD_AGENT)
    assert (a.reply, a.stage, a.status, a.state) == ("It's free, nothing to pay.", 1, 0,
                                                     {"cooperation": 2, "emotion": 1, "trust": 3})
    assert a.well_formed and a.flags == () and not a.parse_error and a.raw == GOOD_AGENT
    u = SC.parse_user_output(GOOD_USER)
    assert (u.reply, u.think, u.status, u.state) == ("Okay, go on.", "hmm", 0,
                                                     {"cooperation": 3, "emotion": 2, "trust": 4})
    assert u.well_formed


def test_missing_tags_are_none_and_flagged():
    u = SC.parse_user_output("<user_reply>Who?</user_reply>")
    assert u.reply == "Who?" and u.status is None and u.state["cooperation"] is None and not u.parse_error
    assert set(u.flags) == {"missing:status", "missing:cooperation", "missing:emotion", "missing:trust"}
    assert "missing:think" not in u.flags


def test_unclosed_tags_read_to_next_tag_or_end():
    u = SC.parse_user_output("<user_reply>I'm busy <user_cooperation>1</user_cooperation><user_status>-1")
    assert u.reply == "I'm busy" and u.state["cooperation"] == 1 and u.status == -1
    assert "unclosed:reply" in u.flags and "unclosed:status" in u.flags and not u.parse_error
    a = SC.parse_agent_output("<stage>2</stage><response>Open the app and tap Boost")
    assert a.reply == "Open the app and tap Boost" and a.stage == 2 and "unclosed:reply" in a.flags


def test_minus_one_status_on_both_sides():
    assert SC.parse_agent_output("<response>Bye.</response><status>-1</status>").status == -1
    assert SC.parse_user_output("<user_reply>Bye.</user_reply><user_status> -1 </user_status>").status == -1


@pytest.mark.parametrize("text,field,expected", [
    ("<user_reply>x</user_reply><user_cooperation>7</user_cooperation>", "cooperation", 4),
    ("<user_reply>x</user_reply><user_emotion>-1</user_emotion>", "emotion", 0),
    ("<user_reply>x</user_reply><user_trust>+9</user_trust>", "trust", 5),
])
def test_out_of_range_user_state_values_are_clamped_and_flagged(text, field, expected):
    u = SC.parse_user_output(text)
    assert u.state[field] == expected and f"clamped:{field}" in u.flags and not u.parse_error


@pytest.mark.parametrize("value", ["3", "-4", "2"])
def test_out_of_range_user_status_is_a_parse_error_not_a_completion(value):
    """A status of 3 used to become 1 (completed): garbage must never end a call."""
    u = SC.parse_user_output(f"<user_reply>x</user_reply><user_status>{value}</user_status>")
    assert u.status is None and "out_of_range:status" in u.flags and u.parse_error


@pytest.mark.parametrize("stage", ["7", "9", "-1", "4"])
def test_out_of_range_agent_stage_is_a_format_problem(stage):
    """Stage 7 used to be silently clamped to 3; it is now flagged and makes the turn a format error."""
    a = SC.parse_agent_output(f"<response>x</response><stage>{stage}</stage><emotion_score>5</emotion_score>")
    assert a.stage is None and a.parse_error and "out_of_range:stage" in a.flags
    assert a.state["emotion"] == 3 and "clamped:emotion" in a.flags


def test_in_range_agent_stage_and_status_parse_cleanly():
    a = SC.parse_agent_output("<response>x</response><stage>3</stage><status>1</status>")
    assert (a.stage, a.status, a.parse_error) == (3, 1, False)
    assert not any(f.startswith("out_of_range") for f in a.flags)


@pytest.mark.parametrize("content", ["high", "2.5", "", "  ", "two"])
def test_non_integer_values_are_invalid(content):
    u = SC.parse_user_output(f"<user_reply>x</user_reply><user_trust>{content}</user_trust>")
    assert u.state["trust"] is None and "invalid:trust" in u.flags and not u.parse_error


@pytest.mark.parametrize("digits", ["9" * 5000, "-" + "7" * 5000, "0" * 5000 + "1", "1" + "0" * 19])
def test_integers_with_thousands_of_digits_never_raise(digits):
    """int() refuses strings over 4300 digits; a parse must still never raise."""
    a = SC.parse_agent_output(f"<response>x</response><status>{digits}</status><stage>{digits}</stage>")
    u = SC.parse_user_output(f"<user_reply>x</user_reply><user_trust>{digits}</user_trust>")
    if digits.startswith("0"):
        assert (a.status, a.stage, u.state["trust"]) == (1, 1, 1) and not a.parse_error
        return
    sign = -1 if digits.startswith("-") else 1
    assert a.status is None and a.stage is None and a.parse_error
    assert {"out_of_range:status", "out_of_range:stage"} <= set(a.flags)
    assert u.state["trust"] == (SC.state_ranges["trust"].max if sign > 0 else SC.state_ranges["trust"].min)
    assert "clamped:trust" in u.flags


def test_leading_integer_with_words_is_read():
    u = SC.parse_user_output("<user_reply>x</user_reply><user_emotion>2 (neutral)</user_emotion>")
    assert u.state["emotion"] == 2 and "invalid:emotion" not in u.flags


def test_several_blocks_take_the_last():
    a = SC.parse_agent_output("<response>draft</response><stage>0</stage><stage>1</stage>"
                              "<response>final answer</response>")
    assert a.reply == "final answer" and a.stage == 1
    assert {"multiple:reply", "multiple:stage"} <= set(a.flags)


def test_tags_are_case_and_space_insensitive():
    u = SC.parse_user_output("< USER_REPLY >Yes.</user_reply ><User_Status>1</ user_status>")
    assert u.reply == "Yes." and u.status == 1 and "unclosed:status" not in u.flags


@pytest.mark.parametrize("text", ["", "just words, no tags", "<response></response>", "<user_reply>   </user_reply>",
                                  "</user_reply>", "<<<>>>", None, 42])
def test_garbage_gives_parse_error_not_exception(text):
    u = SC.parse_user_output(text)
    a = SC.parse_agent_output(text)
    assert u.parse_error and u.reply in (None, "") and a.parse_error and a.reply in (None, "")
    assert isinstance(u.raw, str) and isinstance(a.raw, str)
    assert u.flags and a.flags


def test_fuzzed_tag_soup_never_raises():
    rng = random.Random(0)
    pieces = ["<user_reply>", "</user_reply>", "<user_status>", "</user_status>", "<response>", "</response>",
              "<stage>", "</stage>", "-1", "7", "2.5", "hello", "<", ">", "/", " ", "\n", "<user_trust>", "x" * 3]
    for _ in range(500):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        u, a = SC.parse_user_output(text), SC.parse_agent_output(text)
        for turn in (u, a):
            out_of_range = any(f.startswith("out_of_range:") for f in turn.flags)
            assert turn.parse_error == (not turn.reply or out_of_range)
        assert not PROTOCOL.search(u.reply or "") and not PROTOCOL.search(a.reply or "")
        assert a.status in (None, -1, 0, 1) and u.status in (None, -1, 0, 1)
        assert a.stage in (None, *SC.stage_ids)


def test_format_then_parse_roundtrips():
    state = {"cooperation": 3, "emotion": 0, "trust": 5}
    text = SC.format_user_output("Done, text arrived.", state, 1, think="finally")
    u = SC.parse_user_output(text)
    assert (u.reply, u.think, u.status, u.state) == ("Done, text arrived.", "finally", 1, state)
    assert u.well_formed
    text = SC.format_agent_output("Great, you're all set!", 3, 1, state)
    a = SC.parse_agent_output(text)
    assert (a.reply, a.stage, a.status, a.state) == ("Great, you're all set!", 3, 1, state)
    assert a.well_formed
    partial = SC.format_user_output("Hm.", {"cooperation": None, "emotion": 1, "trust": None}, None)
    assert partial == "<user_reply>Hm.</user_reply>\n<user_emotion>1</user_emotion>"


def test_cue_lists_match_words_and_regexes():
    cues = CueList.compile(["free", "no  charge", "re:\\bswitch(ed)? off\\b", "top right", "?"])
    assert cues.matches("It's FREE!") and not cues.matches("freedom of choice")
    assert cues.hits("There is no\ncharge and it can be switched off") == ["no  charge", "re:\\bswitch(ed)? off\\b"]
    assert cues.hits("Top right corner?") == ["top right", "?"]
    scripted = SC.scripted
    assert scripted.cues["organisation"].matches("Hi, I'm Mia calling from foodloop")
    assert scripted.categories["cost_concerns"].resolve.matches("It won't cost you anything.")
    assert scripted.steps[0].guide.matches("Could you open the FoodLoop Merchant app?")
    assert scripted.effects["pushy"] == {"cooperation": -1, "emotion": -1, "trust": 0}
    assert scripted.effects["step_guided"] == {"cooperation": 0, "emotion": 0, "trust": 0}
    assert scripted.rules.hang_up_at == {"cooperation": 0, "emotion": 0}


def test_templates_have_one_explicit_syntax():
    assert placeholders("a ${x} $$ ${y} $5 {z} $x") == ["x", "y"]
    assert substitute("${x} costs $$3 or $4", {"x": "tea"}) == "tea costs $3 or $4"
    assert substitute("${x} ${dyn}", {"x": "a$b"}, keep_unknown=True) == "a$$b ${dyn}"
    with pytest.raises(TemplateError):
        placeholders("bad ${1x}")
    with pytest.raises(KeyError):
        substitute("${missing}", {})
