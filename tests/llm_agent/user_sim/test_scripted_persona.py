"""The scripted persona against hand-written rule-based agents (in-process, no HTTP).

A good agent follows the SOP (introduces itself, checks identity, answers each doubt by its category, guides the
two steps in order, confirms); a bad one is pushy and robotic, ignores doubts and skips to the last step. Over
60 seeded personas the good one must complete far more often, and every outcome (1, -1, 0) must be reachable.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from llm_agent.scenario import DEFAULT_SCENARIO_PATH, SCENARIO_DIR, UserProfile, load_scenario, sample_behaviors
from llm_agent.user_sim.server.backend import BackendInputError, SamplingParams
from llm_agent.user_sim.server.scripted import ScriptedPersonaBackend
from tests.helpers.profiles import STATUS_COMPLETED, STATUS_CONTINUE, STATUS_ENDED, profile3

REPO_ROOT = Path(__file__).resolve().parents[3]
SCENARIO = load_scenario(DEFAULT_SCENARIO_PATH)
SPEC = SCENARIO.scripted
V = SCENARIO.vars

INTRO = (f"Hi, my name is {V['agent_name']}, calling from {V['platform']}'s merchant growth team. "
         "Am I speaking with the manager?")
PITCH = "I'm calling about a free trial credit that helps your restaurant reach more diners."
ANSWERS = {
    "identity_verification": "I'm on the merchant growth team, and you can check it in the app or call us back "
                             "on the number in your app.",
    "trust_and_scepticism": "There's no catch: no card, no bank details, nothing to pay, and you can see it in "
                            "the app.",
    "cost_concerns": "It's free, nothing is billed when it runs out, and you can switch it off any time.",
    "rule_understanding": "The credit is only used when a diner taps your promoted listing, so it's per click.",
    "suitability_doubts": "It shows places like yours to people near you, so you get new diners.",
    "information_confirmation": f"It's {V['credit_amount']} credits, and you can claim it until {V['deadline']}.",
    "operational_concerns": "It takes about two minutes on your phone, and I'll walk you through it step by step.",
    "communication": "Let me say that again, simply put: a free credit to promote your restaurant.",
    "comparison": f"{V['platform']} has about {V['user_count']} diners and a {V['rating']} rating.",
    "testing": f"I'm a real person, not a recording. I'm {V['agent_name']}.",
    "past_experience": "This one has no risk: you won't be charged, and you can switch it off any time.",
    "boundary_testing": "I can't change the commission or give cash; what I can offer is the trial credit.",
    "expediting": "Sure, it's quick, just two steps.",
    "detail_fixation": "It's the orange button at the top right of the home screen.",
}
OPENERS = ("Fair question.", "I understand.", "Good question.", "No worries.", "That makes sense.")
STEP_GUIDES = (
    (f"Let me walk you through it. First, open the {V['app']} app and find the orange Boost button at the top right.",
     "No rush, take your time. When you're ready, open your merchant app and look for the Boost button."),
    ("Great. Now tap Boost, then tap Claim trial credit.",
     "Take your time. Just press Boost, and then claim the credit with the button that appears."),
)
CONFIRM = ("Did you get the text message and the banner?", "Can you see the confirmation on your screen?")


def test_hand_written_agent_lines_match_the_scenario_cues():
    """Guards the test agents against scenario edits: each line must hit the cues it is meant to hit."""
    assert SPEC.cues["self_intro"].matches(INTRO) and SPEC.cues["organisation"].matches(INTRO)
    assert set(ANSWERS) == set(SPEC.categories)
    for category, answer in ANSWERS.items():
        assert SPEC.categories[category].resolve.matches(answer), category
    for i, guides in enumerate(STEP_GUIDES):
        for text in guides:
            assert SPEC.steps[i].guide.matches(text), text
            assert not any(s.guide.matches(text) for j, s in enumerate(SPEC.steps) if j != i), text
    assert all(SPEC.cues["confirmation"].matches(c) for c in CONFIRM)


class GoodAgent:
    """Follows the SOP: intro + identity, pitch, answer each doubt by category, guide the steps, confirm."""

    def __init__(self, confirm: bool = True) -> None:
        self.turn, self.step, self.pitched, self.confirm = 0, 0, False, confirm

    def respond(self, user_reply: str | None) -> str:
        self.turn += 1
        opener = OPENERS[self.turn % len(OPENERS)]
        if user_reply is None or user_reply in SPEC.lines["ask_who"]:
            return INTRO
        category = next((c for c, script in SPEC.categories.items() if any(d in user_reply for d in script.doubt)),
                        None)
        if category is not None:
            pitch = "" if self.pitched else f" {PITCH}"
            self.pitched = True
            return f"{opener}{pitch} {ANSWERS[category]}"
        if self.step < len(SPEC.steps) and any(line in user_reply for line in SPEC.steps[self.step].done):
            self.step += 1
        if self.step == len(SPEC.steps):
            return CONFIRM[self.turn % 2] if self.confirm else f"{opener} Great, thank you for doing that."
        return STEP_GUIDES[self.step][self.turn % 2]


class BadAgent:
    """Pushy and robotic: ignores the user's doubts and jumps straight to the last step."""

    LINES = (f"Hello, this is {V['agent_name']} from {V['platform']}. Dear valued customer, you must claim your "
             "free trial credit right now.",
             "Kindly note: you have to tap Boost and claim the credit immediately.",
             "Please be informed this is a last chance. Tap claim now, hurry.",
             "Did you get the confirmation? Act now, don't miss out.")

    def __init__(self) -> None:
        self.turn = 0

    def respond(self, user_reply: str | None) -> str:
        self.turn += 1
        return self.LINES[(self.turn - 1) % len(self.LINES)]


def run_dialogue(backend: ScriptedPersonaBackend, profile: UserProfile, agent, seed: int,
                 max_turns: int = 14) -> tuple[int, list]:
    """Play one call; every simulator reply must follow the user tag protocol exactly."""
    dialogue: list = []
    user_reply = None
    for _ in range(max_turns):
        agent_text = agent.respond(user_reply)
        dialogue.append(SCENARIO.parse_agent_output(SCENARIO.format_agent_output(agent_text, 0, 0, {})))
        messages = SCENARIO.render_user_messages(profile, dialogue)
        result = backend.complete(messages, SamplingParams(seed=seed))
        user = SCENARIO.parse_user_output(result.choices[0].text)
        assert user.well_formed, (user.flags, user.raw)
        for dim in ("cooperation", "emotion", "trust"):
            assert SCENARIO.state_ranges[dim].contains(user.state[dim])
        dialogue.append(user)
        user_reply = user.reply
        if user.status in (STATUS_COMPLETED, STATUS_ENDED):
            return user.status, dialogue
    return STATUS_CONTINUE, dialogue


def sample_profile(seed: int) -> UserProfile:
    rng = random.Random(seed)
    c, e, t = rng.choice(SCENARIO.state_space())
    return profile3(c, e, t, tuple(sample_behaviors(SCENARIO.behaviors, rng)))


@pytest.fixture(scope="module")
def backend() -> ScriptedPersonaBackend:
    return ScriptedPersonaBackend(SCENARIO, seed=0)


def test_good_agent_completes_far_more_often_than_bad(backend):
    good = [run_dialogue(backend, sample_profile(s), GoodAgent(), seed=s)[0] for s in range(60)]
    bad = [run_dialogue(backend, sample_profile(s), BadAgent(), seed=s)[0] for s in range(60)]
    good_rate = good.count(STATUS_COMPLETED) / 60
    bad_rate = bad.count(STATUS_COMPLETED) / 60
    assert good_rate > 0.6, good
    assert bad_rate < 0.2, bad
    assert bad.count(STATUS_ENDED) > 40, "the pushy agent mostly gets hung up on"


def test_every_outcome_is_reachable(backend):
    outcomes = {run_dialogue(backend, sample_profile(s), GoodAgent(), seed=s)[0] for s in range(20)}
    outcomes |= {run_dialogue(backend, sample_profile(s), BadAgent(), seed=s)[0] for s in range(5)}
    outcomes |= {run_dialogue(backend, sample_profile(s), GoodAgent(confirm=False), seed=s, max_turns=10)[0]
                 for s in range(5)}
    assert outcomes == {STATUS_COMPLETED, STATUS_ENDED, STATUS_CONTINUE}


def test_completion_needs_every_step_in_order_and_a_confirmation(backend):
    profile = profile3(4, 3, 5, ())
    status, dialogue = run_dialogue(backend, profile, GoodAgent(), seed=1)
    assert status == STATUS_COMPLETED
    replies = [t.reply for t in dialogue[1::2]]
    assert replies[-1] in SPEC.lines["completed"]
    for step in SPEC.steps:
        assert any(r in step.done for r in replies), step.id

    class SkipFirstStep(GoodAgent):
        def respond(self, user_reply):
            text = super().respond(user_reply)
            if self.step == 0 and text in STEP_GUIDES[0]:
                self.step = 1  # never guides step 1: jumps to step 2 and then keeps confirming
                return STEP_GUIDES[1][0]
            return text

    status, dialogue = run_dialogue(backend, profile, SkipFirstStep(), seed=1, max_turns=10)
    assert status != STATUS_COMPLETED
    assert not any(t.reply in SPEC.lines["completed"] for t in dialogue[1::2])


def test_hang_up_when_a_doubt_is_ignored_past_patience(backend):
    profile = profile3(4, 3, 5, (next(b for b in SCENARIO.behaviors if b.category == "cost_concerns"),))
    # Kind but evasive: empathy keeps the mood up, so only the patience rule can end the call.
    agent_lines = [INTRO, "I understand, that matters to you.", "No worries, I hear you.",
                   "Sorry, that makes sense.", "I get it, take your time.", "I know you're busy, of course."]
    dialogue: list = []
    statuses = []
    for text in agent_lines:
        dialogue.append(SCENARIO.parse_agent_output(SCENARIO.format_agent_output(text, 0, 0, {})))
        user = SCENARIO.parse_user_output(backend.complete(SCENARIO.render_user_messages(profile, dialogue),
                                                           SamplingParams(seed=3)).choices[0].text)
        dialogue.append(user)
        statuses.append(user.status)
        if user.status == STATUS_ENDED:
            break
    patience = SPEC.rules.doubt_patience
    assert statuses[-1] == STATUS_ENDED and dialogue[-1].reply in SPEC.lines["hang_up"]
    assert len(statuses) == patience + 2, statuses  # intro (doubt raised), then patience+1 unanswered turns


def test_hang_up_when_emotion_falls_to_the_floor(backend):
    profile = profile3(4, 1, 5, ())
    status, dialogue = run_dialogue(backend, profile, BadAgent(), seed=0)
    assert status == STATUS_ENDED
    last = dialogue[-1].state
    assert last["emotion"] == SCENARIO.state_ranges["emotion"].min or last["cooperation"] == 0
    assert len(dialogue) == 2, "emotion 1 minus a pushy first turn reaches the floor at once"


def test_same_input_same_output_and_state_independent_of_wording(backend):
    profile = sample_profile(11)
    _, dialogue = run_dialogue(backend, profile, GoodAgent(), seed=5, max_turns=4)
    messages = SCENARIO.render_user_messages(profile, dialogue[:-1])
    params = SamplingParams(n=4, seed=9, temperature=1.0)
    first = [c.text for c in backend.complete(messages, params).choices]
    again = [c.text for c in ScriptedPersonaBackend(SCENARIO, seed=0).complete(messages, params).choices]
    assert first == again
    parsed = [SCENARIO.parse_user_output(t) for t in first]
    assert len({(p.state["cooperation"], p.state["emotion"], p.state["trust"], p.status) for p in parsed}) == 1
    assert parsed[0].state == dialogue[-1].state, "replay recomputes the recorded state"
    greedy = backend.complete(messages, SamplingParams(n=2, seed=1, temperature=0.0)).choices
    assert greedy[0].text == greedy[1].text


def test_prefix_cache_gives_the_same_transcript_as_full_replay(backend):
    uncached = ScriptedPersonaBackend(SCENARIO, seed=0, cache_size=0)
    for seed in range(8):
        for agent in (GoodAgent, BadAgent):
            cached_run = run_dialogue(backend, sample_profile(seed), agent(), seed=seed)
            full_run = run_dialogue(uncached, sample_profile(seed), agent(), seed=seed)
            assert [t.raw for t in cached_run[1]] == [t.raw for t in full_run[1]]
    assert not uncached._cache and backend._cache


def reference_token_count(text: str) -> int:
    """Words (runs of letters, digits and '_') plus every other non-space character, one character at a time."""
    count, in_word = 0, False
    for ch in text:
        word = ch.isalnum() or ch == "_"
        count += (word and not in_word) or (not word and not ch.isspace())
        in_word = word
    return count


def test_prompt_tokens_counted_from_the_cache_equal_a_full_count(monkeypatch):
    """On a prefix-cache hit only the two new messages are counted for `usage.prompt_tokens`; the total must still
    equal a count of every message at every turn."""
    import llm_agent.user_sim.server.scripted as scripted

    counted: list[int] = []
    real_count = scripted.count_tokens
    monkeypatch.setattr(scripted, "count_tokens", lambda text: counted.append(1) or real_count(text))
    backend = ScriptedPersonaBackend(SCENARIO, seed=0)
    profile, agent, dialogue, user_reply = sample_profile(3), GoodAgent(), [], None
    for turn in range(6):
        dialogue.append(SCENARIO.parse_agent_output(SCENARIO.format_agent_output(agent.respond(user_reply), 0, 0, {})))
        messages = SCENARIO.render_user_messages(profile, dialogue)
        counted.clear()
        result = backend.complete(messages, SamplingParams(seed=turn))
        assert result.prompt_tokens == sum(reference_token_count(m["content"]) for m in messages), turn
        assert len(counted) == (len(messages) if turn == 0 else 2), turn  # the cache was used from turn 1 on
        user = SCENARIO.parse_user_output(result.choices[0].text)
        dialogue.append(user)
        user_reply = user.reply
        if user.status != STATUS_CONTINUE:
            break
    assert turn >= 2


def test_recorded_state_tags_override_the_replay(backend):
    profile = profile3(2, 2, 2, ())
    dialogue = [SCENARIO.parse_agent_output(SCENARIO.format_agent_output(INTRO, 0, 0, {}))]
    messages = SCENARIO.render_user_messages(profile, dialogue)
    messages.append({"role": "assistant", "content": SCENARIO.format_user_output(
        "Yes, go on.", {"cooperation": 4, "emotion": 3, "trust": 5}, 0)})
    messages.append({"role": "user", "content": STEP_GUIDES[0][0]})
    user = SCENARIO.parse_user_output(backend.complete(messages, SamplingParams(seed=0)).choices[0].text)
    assert user.reply in SPEC.steps[0].done, "cooperation 4 from the record lets the user act"
    assert user.state["cooperation"] == 4


@pytest.mark.parametrize("messages, match", [
    ([{"role": "user", "content": "hi"}], "persona system message"),
    ([{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "hi"}], "not a persona"),
    ("persona_only", "last message"),
    ("tool_role", "role 'tool'"),
])
def test_bad_conversations_raise_backend_input_error(backend, messages, match):
    persona = SCENARIO.render_user_prompt(profile3(2, 2, 2, ()))
    if messages == "persona_only":
        messages = [{"role": "system", "content": persona}]
    elif messages == "tool_role":
        messages = [{"role": "system", "content": persona}, {"role": "tool", "content": "x"},
                    {"role": "user", "content": "hi"}]
    with pytest.raises(BackendInputError, match=match):
        backend.complete(messages, SamplingParams())


def test_max_tokens_truncates_with_finish_reason_length(backend):
    messages = SCENARIO.render_user_messages(profile3(2, 2, 2, ()), [
        SCENARIO.parse_agent_output(SCENARIO.format_agent_output(INTRO, 0, 0, {}))])
    full = backend.complete(messages, SamplingParams(seed=0)).choices[0]
    short = backend.complete(messages, SamplingParams(seed=0, max_tokens=5)).choices[0]
    assert full.finish_reason == "stop" and short.finish_reason == "length"
    assert short.completion_tokens == 5 and full.text.startswith(short.text)


SCENARIO_FILES = sorted(SCENARIO_DIR.glob("*.yaml"))


def _plain(cues) -> list[str]:
    return [c for c in cues.sources if not c.startswith("re:")]


@pytest.mark.parametrize("path", SCENARIO_FILES, ids=[p.stem for p in SCENARIO_FILES])
def test_any_scenario_is_driven_by_its_data_alone(path):
    """No per-scenario code: a cue-reading oracle completes each shipped scenario, and random cue soup always gets
    protocol-exact replies made of that scenario's own lines."""
    scenario = load_scenario(path)
    spec = scenario.scripted
    backend = ScriptedPersonaBackend(scenario, seed=0)
    first_stage = spec.stage_cues[scenario.stage_ids[0]]
    oracle = [f"Hello, {_plain(spec.cues['self_intro'])[0]} Sam, {_plain(spec.cues['organisation'])[0]}. "
              f"About the {_plain(first_stage)[0]}."]
    oracle += [f"Please {_plain(step.guide)[0]}." for step in spec.steps]
    oracle += [f"{_plain(spec.cues['confirmation'])[0].capitalize()}?"]

    def play(profile: UserProfile, texts: list[str], seed: int) -> list:
        dialogue: list = []
        for text in texts:
            dialogue.append(scenario.parse_agent_output(scenario.format_agent_output(text, 0, 0, {})))
            reply = backend.complete(scenario.render_user_messages(profile, dialogue), SamplingParams(seed=seed))
            user = scenario.parse_user_output(reply.choices[0].text)
            assert user.well_formed, (user.flags, user.raw)
            assert all(scenario.state_ranges[d].contains(user.state[d]) for d in user.state)
            dialogue.append(user)
            if user.status != STATUS_CONTINUE:
                break
        return dialogue

    best = {d.name: d.range.max if d.sign > 0 else d.range.min for d in scenario.state_schema.dimensions}
    finished = play(UserProfile(best), oracle, seed=0)
    assert finished[-1].status == STATUS_COMPLETED, [t.reply for t in finished]

    known = {line for lines in spec.lines.values() for line in lines}
    known |= {line for step in spec.steps for line in step.done}
    doubts = {line for c in spec.categories.values() for line in c.doubt}
    phrases = sorted({p for cues in [*spec.cues.values(), *spec.stage_cues.values(),
                                     *(s.guide for s in spec.steps), *(c.resolve for c in spec.categories.values())]
                      for p in _plain(cues)})
    outcomes = set()
    for seed in range(30):
        rng = random.Random(seed)
        profile = scenario.profile(rng.choice(scenario.state_space()), sample_behaviors(scenario.behaviors, rng))
        texts = [" ".join(rng.sample(phrases, rng.randint(1, 4))) + "." for _ in range(12)]
        dialogue = play(profile, texts, seed)
        for user in dialogue[1::2]:
            assert user.reply in known or any(user.reply.endswith(d) for d in doubts), user.reply
        outcomes.add(dialogue[-1].status)
    assert STATUS_ENDED in outcomes


def _say(backend, scenario, profile, dialogue: list, text: str, seed: int = 0):
    """Append one agent turn and the persona's parsed answer to `dialogue`; return the answer."""
    dialogue.append(scenario.parse_agent_output(scenario.format_agent_output(text, 0, 0, {})))
    reply = backend.complete(scenario.render_user_messages(profile, dialogue), SamplingParams(seed=seed))
    user = scenario.parse_user_output(reply.choices[0].text)
    dialogue.append(user)
    return user


def _cue_soup(scenario) -> str:
    """One turn stuffed with a cue of everything: intro, every stage, every doubt answer, every step, confirm."""
    spec = scenario.scripted
    lists = [spec.cues["self_intro"], spec.cues["organisation"], spec.cues["empathy"], *spec.stage_cues.values(),
             *(c.resolve for c in spec.categories.values()), *(s.guide for s in spec.steps),
             spec.cues["confirmation"]]
    return " ".join(_plain(cues)[0] for cues in lists) + "."


@pytest.mark.parametrize("path", SCENARIO_FILES, ids=[p.stem for p in SCENARIO_FILES])
def test_a_repeated_keyword_soup_turn_never_completes(path):
    """The cheapest RL exploit: say one turn holding every cue phrase, every turn. It must never complete."""
    scenario = load_scenario(path)
    backend = ScriptedPersonaBackend(scenario, seed=0)
    soup = _cue_soup(scenario)
    outcomes = []
    for seed in range(20):
        rng = random.Random(seed)
        profile = scenario.profile(rng.choice(scenario.state_space()), sample_behaviors(scenario.behaviors, rng))
        dialogue: list = []
        for _ in range(12):
            user = _say(backend, scenario, profile, dialogue, soup, seed)
            if user.status != STATUS_CONTINUE:
                break
        outcomes.append(dialogue[-1].status)
    assert STATUS_COMPLETED not in outcomes, outcomes
    assert outcomes.count(STATUS_ENDED) == len(outcomes), "overloaded turns wear the user down to a hang-up"


def test_an_overlong_or_stuffed_turn_counts_for_nothing(backend):
    profile = profile3(4, 3, 5, ())
    padding = " ".join(["so"] * (SPEC.rules.max_words + 1))
    dialogue: list = []
    user = _say(backend, SCENARIO, profile, dialogue, f"{INTRO} {padding}")
    assert user.reply in SPEC.lines["overloaded"], "too long: the introduction is not taken in"
    assert (user.state["cooperation"], user.state["emotion"]) == (3, 2), "the overloaded effect applies"
    user = _say(backend, SCENARIO, profile, dialogue, INTRO)
    assert user.reply in SPEC.lines["greeting"], "the same introduction, short, is heard"
    stuffed = f"{STEP_GUIDES[0][0]} {_cue_soup(SCENARIO)}"
    assert len(stuffed.split()) <= 2 * SPEC.rules.max_words
    before = user.state["cooperation"]
    user = _say(backend, SCENARIO, profile, dialogue, stuffed)
    assert user.reply in SPEC.lines["overloaded"] and user.state["cooperation"] == before - 1


def test_two_steps_guided_in_one_turn_are_not_performed(backend):
    profile = profile3(4, 3, 5, ())
    dialogue: list = []
    _say(backend, SCENARIO, profile, dialogue, INTRO)
    both = f"{STEP_GUIDES[0][0]} {STEP_GUIDES[1][0]}"
    assert SPEC.steps[0].guide.matches(both) and SPEC.steps[1].guide.matches(both)
    user = _say(backend, SCENARIO, profile, dialogue, both)
    assert user.reply not in SPEC.steps[0].done, "both steps at once: neither is done"
    user = _say(backend, SCENARIO, profile, dialogue, STEP_GUIDES[0][1])
    assert user.reply in SPEC.steps[0].done, "one step per turn works"
    user = _say(backend, SCENARIO, profile, dialogue, f"{STEP_GUIDES[1][0]} {CONFIRM[0]}")
    assert user.reply in SPEC.steps[1].done, "the last step and the confirmation in one turn: only the step"
    user = _say(backend, SCENARIO, profile, dialogue, CONFIRM[1])
    assert user.status == STATUS_COMPLETED


def test_repeating_any_earlier_turn_is_penalised(backend):
    profile = profile3(4, 3, 5, ())
    effect = SPEC.effects["repetition"]
    assert effect["trust"] < 0 and effect["emotion"] < 0, "the shipped scenario penalises repetition"
    dialogue: list = []
    _say(backend, SCENARIO, profile, dialogue, INTRO)
    _say(backend, SCENARIO, profile, dialogue, PITCH)
    before = _say(backend, SCENARIO, profile, dialogue, "Good question, it's for your restaurant.")
    again = _say(backend, SCENARIO, profile, dialogue, PITCH.upper())  # the same words, two turns later
    assert "repetition" in again.think
    assert again.state["trust"] == before.state["trust"] + effect["trust"]
    assert again.state["emotion"] == before.state["emotion"] + effect["emotion"]


def test_repetition_check_cost_is_bounded():
    """Two long, nearly equal turns are compared in bounded time (word-level, capped)."""
    import time
    from llm_agent.user_sim.server.repetition import similar as _similar

    words = [f"w{i % 997}" for i in range(60_000)]
    a, b = " ".join(words), " ".join(words[:-5] + ["x"] * 5)
    start = time.monotonic()
    assert _similar(a, b)
    assert not _similar(a, "something else entirely")
    assert time.monotonic() - start < 2.0


def test_sounding_robotic_costs_completions(backend):
    """Robotic talk drains trust, and a user with trust below act_min_trust touches nothing in the app."""

    class RoboticGoodAgent(GoodAgent):
        def respond(self, user_reply):
            return "Kindly note: " + super().respond(user_reply)

    assert SPEC.rules.act_min["trust"] > 0 and SPEC.effects["robotic"]["trust"] < 0
    plain = [run_dialogue(backend, sample_profile(s), GoodAgent(), seed=s)[0] for s in range(40)]
    robotic = [run_dialogue(backend, sample_profile(s), RoboticGoodAgent(), seed=s)[0] for s in range(40)]
    assert robotic.count(STATUS_COMPLETED) < plain.count(STATUS_COMPLETED) - 10, (plain, robotic)
    status, dialogue = run_dialogue(backend, profile3(4, 3, 0, ()), GoodAgent(), seed=0)
    assert status == STATUS_COMPLETED, "trust 0 at the start is won back by the introduction"
    status, dialogue = run_dialogue(backend, profile3(4, 3, 0, ()), RoboticGoodAgent(), seed=0, max_turns=6)
    assert status != STATUS_COMPLETED
    assert any(t.reply in SPEC.lines["reluctant"] for t in dialogue[1::2]), "guided, but too distrustful to act"
