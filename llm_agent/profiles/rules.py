"""The rule-based consistency of user profiles: behaviour categories that contradict an initial state.

`load_rule_table(path)` reads the annotation `assets/behavior_rules.yaml` (its header documents the format):
per behaviour category, the conditions on the state's levels (the value's position in its range, 0 = bottom,
1 = top) under which the category contradicts the state. `RuleTable.violations(profile, ranges)` lists the
broken rules of a profile, `RuleTable.allowed(library, state, ranges)` the behaviours a state may draw and
`RuleTable.sample(...)` draws like `llm_agent.scenario.sample_behaviors` from those only. Deterministic: no
LLM is involved.
"""
from __future__ import annotations

import logging
import os
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from llm_agent.scenario import Behavior, StateRange, UserProfile, sample_behaviors

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_RULES_PATH", "Condition", "RuleTable", "Violation", "load_rule_table", "state_levels"]

DEFAULT_RULES_PATH = Path(__file__).resolve().parents[2] / "assets" / "behavior_rules.yaml"


def state_levels(state: Mapping[str, int] | Sequence[int], ranges: Mapping[str, StateRange]) -> dict[str, float]:
    """{dimension: (value - min) / (max - min)} of a state ({dimension: value}, or values in the order of `ranges`,
    the scenario's dimensions; 0 for a one-value range)."""
    values = state if isinstance(state, Mapping) else dict(zip(ranges, state, strict=True))
    return {dim: 0.0 if rng.max == rng.min else (values[dim] - rng.min) / (rng.max - rng.min)
            for dim, rng in ranges.items()}


@dataclass(frozen=True)
class Condition:
    """Every named dimension's level lies in its closed interval."""

    bounds: tuple[tuple[str, float, float], ...]

    def matches(self, levels: Mapping[str, float]) -> bool:
        """True when every bound holds for `levels` (a small tolerance absorbs 1/3-style rounding)."""
        return all(lo - 1e-9 <= levels[dim] <= hi + 1e-9 for dim, lo, hi in self.bounds)

    @property
    def dims(self) -> set[str]:
        """The dimensions the condition names."""
        return {dim for dim, _, _ in self.bounds}

    def describe(self) -> str:
        """E.g. "trust level in [0.6, 1]"."""
        return " and ".join(f"{dim} level in [{lo:g}, {hi:g}]" for dim, lo, hi in self.bounds)


@dataclass(frozen=True)
class Violation:
    """One behaviour of a profile whose category contradicts the profile's state."""

    behavior: Behavior
    condition: Condition
    why: str

    def to_dict(self) -> dict[str, str]:
        """JSON-ready form (for reports and the kept rejected answers)."""
        return {"category": self.behavior.category, "behavior": self.behavior.behavior,
                "condition": self.condition.describe(), "why": self.why}


@dataclass(frozen=True)
class RuleTable:
    """Per behaviour category: the conditions under which it contradicts a state, and why."""

    path: str
    rules: dict[str, tuple[Condition, ...]]
    reasons: dict[str, str]

    def check_library(self, library: Sequence[Behavior], where: str = "library",
                      dims: Sequence[str] | None = None) -> None:
        """ValueError naming the file and the categories of `library` that the table does not list, or (with the
        scenario's `dims`) whose conditions name a dimension the scenario does not have."""
        categories = {b.category for b in library}
        missing = sorted(categories - set(self.rules))
        if missing:
            raise ValueError(f"{self.path}: no rule for behaviour categor{'y' if len(missing) == 1 else 'ies'} "
                             f"{missing} of the {where}; add an entry (contradicts: [] if it fits every state)")
        if dims is not None:
            for category in sorted(categories):
                unknown = sorted({d for c in self.rules[category] for d in c.dims} - set(dims))
                if unknown:
                    raise ValueError(f"{self.path}: categories.{category} names dimension(s) {unknown}, which the "
                                     f"{where} does not have (its dimensions: {list(dims)})")

    def contradiction(self, category: str, levels: Mapping[str, float]) -> Condition | None:
        """The first condition of `category` that `levels` match, or None (unknown category: KeyError)."""
        return next((c for c in self.rules[category] if c.matches(levels)), None)

    def violations(self, profile: UserProfile, ranges: Mapping[str, StateRange]) -> list[Violation]:
        """The profile's behaviours whose category contradicts its initial state (empty: consistent)."""
        levels = state_levels(profile.state, ranges)
        out = []
        for b in profile.behaviors:
            if b.category not in self.rules:
                raise ValueError(f"{self.path}: no rule for behaviour category {b.category!r}")
            cond = self.contradiction(b.category, levels)
            if cond is not None:
                out.append(Violation(b, cond, self.reasons[b.category]))
        return out

    def allowed(self, library: Sequence[Behavior], state: Sequence[int],
                ranges: Mapping[str, StateRange]) -> list[Behavior]:
        """The behaviours of `library` (in its order) whose category does not contradict `state`."""
        levels = state_levels(state, ranges)
        return [b for b in library if self.contradiction(b.category, levels) is None]

    def sample(self, library: Sequence[Behavior], state: Sequence[int], ranges: Mapping[str, StateRange],
               rng: random.Random, min_count: int, max_count: int) -> list[Behavior]:
        """Like `sample_behaviors`, from the behaviours `state` allows only (fewer when fewer are allowed)."""
        pool = self.allowed(library, state, ranges)
        if len(pool) < min_count:
            logger.warning("only %d behaviours fit state %s under %s (min %d)", len(pool), tuple(state),
                           self.path, min_count)
        return sample_behaviors(pool, rng, min_count, max_count)


def _bounds(value: Any, where: str) -> tuple[float, float]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in value)):
        raise ValueError(f"{where}: must be [low, high] levels, got {value!r}")
    lo, hi = float(value[0]), float(value[1])
    if not 0.0 <= lo <= hi <= 1.0:
        raise ValueError(f"{where}: need 0 <= low <= high <= 1, got {value!r}")
    return lo, hi


def load_rule_table(path: str | os.PathLike | None = None,
                    categories: Collection[str] | None = None) -> RuleTable:
    """Read and validate a rule table (default: assets/behavior_rules.yaml); ValueError naming the file and key.

    With `categories`, every one of them must have an entry."""
    path = Path(path) if path is not None else DEFAULT_RULES_PATH
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: cannot read the behaviour rule table: {exc}") from None
    if not isinstance(data, Mapping) or not isinstance(data.get("categories"), Mapping):
        raise ValueError(f"{path}: must be a mapping with a 'categories' mapping")
    rules: dict[str, tuple[Condition, ...]] = {}
    reasons: dict[str, str] = {}
    for category, entry in data["categories"].items():
        where = f"{path}: categories.{category}"
        if not isinstance(entry, Mapping) or set(entry) != {"why", "contradicts"}:
            raise ValueError(f"{where}: must have exactly the keys 'why' and 'contradicts'")
        if not isinstance(entry["why"], str) or not entry["why"].strip():
            raise ValueError(f"{where}.why: must be a non-empty string (the reason of the rule)")
        if not isinstance(entry["contradicts"], list):
            raise ValueError(f"{where}.contradicts: must be a list of conditions ([] = fits every state)")
        conditions = []
        for i, cond in enumerate(entry["contradicts"]):
            if not isinstance(cond, Mapping) or not cond or not all(isinstance(d, str) and d for d in cond):
                raise ValueError(f"{where}.contradicts[{i}]: must map some state dimensions to [low, high]")
            conditions.append(Condition(tuple((dim, *_bounds(cond[dim], f"{where}.contradicts[{i}].{dim}"))
                                              for dim in cond)))
        rules[str(category)] = tuple(conditions)
        reasons[str(category)] = " ".join(entry["why"].split())
    table = RuleTable(str(path), rules, reasons)
    if categories is not None:
        missing = sorted(set(categories) - set(rules))
        if missing:
            raise ValueError(f"{path}: no rule for behaviour categories {missing}")
    return table
