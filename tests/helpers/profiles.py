"""The shipped scenarios' user-state schema for tests that write states by hand: their dimensions in order, their
status values, and a profile from positional values."""
from __future__ import annotations

from collections.abc import Sequence

from llm_agent.scenario import Behavior, UserProfile

DIMS: tuple[str, ...] = ("cooperation", "emotion", "trust")  # inbound_support's and outbound_ad_trial's dimensions
STATUS_COMPLETED, STATUS_CONTINUE, STATUS_ENDED = 1, 0, -1  # their status values (the defaults)


def profile3(cooperation: int, emotion: int, trust: int, behaviors: Sequence[Behavior] = ()) -> UserProfile:
    """A profile of the shipped scenarios' schema."""
    return UserProfile({"cooperation": cooperation, "emotion": emotion, "trust": trust}, tuple(behaviors))
