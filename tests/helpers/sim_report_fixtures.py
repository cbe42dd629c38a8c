"""Hand-built simulator requests and replies for the report-card tests (values worked out by hand from the
outbound scenario's `scripted` section: see each constant's comment)."""
from __future__ import annotations

from llm_agent.scenario import Scenario, UserProfile
from tests.helpers.profiles import profile3

INTRO = "Hello, this is Mia from FoodLoop."  # self_intro + organisation: `introduced`, trust +1, nothing else
PUSHY = "You have to act now, right now!"  # pushy (c -1, e -1) + doubt_ignored (e -1) + no_progress (e -1)
NEUTRAL = "Okay."  # nothing useful: no_progress (e -1), and doubt_ignored (e -1) while a doubt is open
COST_DOUBT = "What's this going to cost?"  # 4 of the 4 content words of "So what's this going to cost me..."


def agent(scenario: Scenario, text: str):
    """A well-formed agent turn saying `text`."""
    return scenario.parse_agent_output(scenario.format_agent_output(
        text, 0, 0, {"cooperation": 2, "emotion": 2, "trust": 2}))


def user(scenario: Scenario, text: str, state: tuple[int, int, int], status: int = 0, think: str | None = None):
    """A user turn with `state` (cooperation, emotion, trust), as the canonical protocol writes it."""
    return scenario.parse_user_output(reply_text(scenario, text, state, status, think))


def reply_text(scenario: Scenario, text: str, state: tuple[int, int, int], status: int = 0,
               think: str | None = None) -> str:
    """A reply in the exact user tag protocol."""
    return scenario.format_user_output(text, dict(zip(("cooperation", "emotion", "trust"), state)), status,
                                       think=think)


def profile(scenario: Scenario, state: tuple[int, int, int], *categories: str) -> UserProfile:
    """A profile with the library's first behaviour of each category."""
    first = {}
    for b in scenario.behaviors:
        first.setdefault(b.category, b)
    return profile3(*state, behaviors=tuple(first[c] for c in categories))
