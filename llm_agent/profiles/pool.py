"""A pool of profiles written ahead (by utils/generate_profiles.py), looked up by initial state.

A pool file is JSONL: each line either a profile object (`UserProfile.to_dict()`) or a profile writer row,
`{"index", "source", ..., "profile": {...}}`. `read_profile_file` validates every line against the scenario
(state in range, every behaviour in its library) and names the file and line of a bad one.
`ProfilePool.draw(state, rng)` returns one of the pool's profiles with exactly that initial state, or None.
"""
from __future__ import annotations

import json
import logging
import os
import random
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from llm_agent.scenario import Scenario, UserProfile

logger = logging.getLogger(__name__)

__all__ = ["ProfilePool", "profile_of_row", "read_profile_file"]


def profile_of_row(row: Any) -> UserProfile:
    """The profile of a pool line: a writer row's "profile" or the line itself; ValueError when malformed."""
    if isinstance(row, dict) and "profile" in row:
        row = row["profile"]
    return UserProfile.from_dict(row)


def read_profile_file(path: str | os.PathLike, scenario: Scenario,
                      check_library: bool = True) -> list[UserProfile]:
    """Every profile of a pool/profiles JSONL file in order; ValueError naming the file and line of a bad one
    (bad JSON, a missing or mistyped field, a state outside the ranges, a behaviour not in the library)."""
    library = set(scenario.behaviors)
    profiles = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                profile = profile_of_row(json.loads(line))
                scenario.check_profile(profile)
                unknown = [b.behavior for b in profile.behaviors if b not in library]
                if check_library and unknown:
                    raise ValueError(f"behaviour(s) not in the library of scenario {scenario.name}: {unknown}")
            except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
                raise ValueError(f"{path}:{lineno}: bad profile: {exc}") from None
            profiles.append(profile)
    return profiles


class ProfilePool:
    """Profiles grouped by initial state key ("c2-e1-t3", the scenario's `StateSchema.key`); `draw` picks one of a
    state uniformly."""

    def __init__(self, profiles: Sequence[UserProfile], scenario: Scenario, source: str = "<memory>") -> None:
        if not profiles:
            raise ValueError(f"{source}: the profile pool is empty")
        self.source = source
        self._by_state: dict[str, list[UserProfile]] = defaultdict(list)
        for p in profiles:
            self._by_state[scenario.state_key(p.state)].append(p)
        self.size = len(profiles)

    @classmethod
    def load(cls, path: str | os.PathLike, scenario: Scenario) -> "ProfilePool":
        """Read and validate a pool file (see `read_profile_file`)."""
        pool = cls(read_profile_file(path, scenario), scenario, str(path))
        logger.info("profile pool %s: %d profiles over %d states", path, pool.size, len(pool._by_state))
        return pool

    @property
    def state_keys(self) -> list[str]:
        """The state keys the pool holds profiles for, sorted."""
        return sorted(self._by_state)

    def count(self, key: str) -> int:
        """How many profiles the pool holds for state key `key`."""
        return len(self._by_state.get(key, ()))

    def draw(self, key: str, rng: random.Random) -> UserProfile | None:
        """A uniformly chosen profile of state key `key`, or None when the pool has none."""
        candidates = self._by_state.get(key)
        return rng.choice(candidates) if candidates else None
