"""The state controller: samples the simulated users' initial states and re-weights them online.

`StateController.sample(n)` draws `UserProfile`s: an initial state (the scenario's dimensions) from the current
sampling weights and `min_behaviors..max_behaviors` distinct behaviours from the scenario's library. After every
training step `update(outcomes)` takes one `(state_key, completed)` pair per dialogue (errors excluded by the
caller) and moves the weights toward harder or easier initial states so that the completion rate (CR) tracks
`target_completion_rate`. How the behaviours are drawn is `profile_source`: `uniform` (any 1-3 of the library),
`rules` (only behaviours whose category does not contradict the drawn state, per the rule table
`assets/behavior_rules.yaml`, see `llm_agent.profiles.rules`) or `pool` (a profile written ahead with exactly the
drawn state, from `pool_path`; a state the pool lacks falls back to `rules` and is counted). The rule is the
original SEAD one (analyze_chatbot_mistakes.py), applied per value of each dimension, or per combination of values
when `joint` is set. States are tuples of values in the scenario's dimension order; their keys ("c2-e1-t3") are
the scenario's `StateSchema.key`. With d = CR - target, per value v with
success rate sr(v) over count(v) dialogues (unseen: sr = 0.5, count = 1):

    d < -dead_band:  w(v) = 1 + 2|d| * sr(v)          (mass toward easy values)
    d >  dead_band:  w(v) = 1 + 2d * (1 - sr(v))      (mass toward hard values)
    otherwise:       w(v) = 1 + 0.1 / count(v)

normalised over the valid values (the range without its extremes unless `allow_extremes`; invalid values have
weight 0). The new weights are `(1 - smoothing) * old + smoothing * target`, then bounded by `bound_weights`:
every valid value gets at least `floor` and max/min <= `max_ratio`.
"""
from __future__ import annotations

import itertools
import logging
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from llm_agent.profiles.pool import ProfilePool
from llm_agent.profiles.rules import RuleTable, load_rule_table
from llm_agent.scenario import Scenario, UserProfile, sample_behaviors
from verl.trainer.config_ranges import check_number
from verl.trainer.config_schema import ConfigError
from verl.trainer.config_validation import ConfigSection, config_key

logger = logging.getLogger(__name__)

_STATE_VERSION = 1
PROFILE_SOURCES = ("uniform", "rules", "pool")


@dataclass
class ControllerConfig(ConfigSection):
    """Settings of the state controller (see the module docstring for the update rule).

    `enabled` is read by the rollout loop (disabled: profiles come from the dataset). `smoothing` is the weight
    of the new target in the exponential moving average (1 = no smoothing). `floor` is the least weight of any
    valid value and `max_ratio` the largest allowed max/min between valid values (`.inf`: no limit).
    `profile_source` picks how behaviours are drawn (uniform | rules | pool); `rules_path` is the rule table
    (None: assets/behavior_rules.yaml) and `pool_path` the profiles written ahead (required by `pool`).
    """

    SECTION_KEY = "controller"

    enabled: bool = True
    target_completion_rate: float = 0.5
    dead_band: float = 0.1
    smoothing: float = 0.5
    floor: float = 0.02
    max_ratio: float = 4.0
    joint: bool = False
    allow_extremes: bool = False
    min_behaviors: int = 1
    max_behaviors: int = 3
    seed: int = 0
    profile_source: str = "rules"
    rules_path: str | None = None
    pool_path: str | None = None

    def __post_init__(self) -> None:
        check_number(config_key("target_completion_rate"), self.target_completion_rate, 0.0, 1.0)
        check_number(config_key("dead_band"), self.dead_band, 0.0, 1.0, high_open=True)
        check_number(config_key("smoothing"), self.smoothing, 0.0, 1.0, low_open=True)
        check_number(config_key("floor"), self.floor, 0.0, 1.0, high_open=True)
        check_number(config_key("max_ratio"), self.max_ratio, 1.0, allow_inf=True)
        check_number(config_key("min_behaviors"), self.min_behaviors, 0)
        if self.max_behaviors < self.min_behaviors:
            raise ConfigError(f"{config_key('max_behaviors')}={self.max_behaviors} must be >= "
                              f"{config_key('min_behaviors')} ({self.min_behaviors})")
        if self.profile_source not in PROFILE_SOURCES:
            raise ConfigError(f"{config_key('profile_source')}={self.profile_source!r} must be one of "
                              f"{list(PROFILE_SOURCES)}")
        if self.profile_source == "pool" and not self.pool_path:
            raise ConfigError(f"{config_key('pool_path')}={self.pool_path!r} must name the profiles file when "
                              "profile_source is pool")


def rule_weight(deviation: float, dead_band: float, completed: int, count: int) -> float:
    """The unnormalised SEAD weight of one value from the CR deviation and its (completed, count) tally."""
    sr, count = (completed / count, count) if count else (0.5, 1)
    if deviation < -dead_band:
        return 1.0 + 2.0 * abs(deviation) * sr
    if deviation > dead_band:
        return 1.0 + 2.0 * deviation * (1.0 - sr)
    return 1.0 + 0.1 / count


def bound_weights(weights: Sequence[float], floor: float, max_ratio: float) -> list[float]:
    """Normalise positive `weights` so each is >= `floor` and max/min <= `max_ratio` (needs floor*n <= 1).

    Low values are lifted, high ones scaled down. The result is the fixed point of "clip every weight up to
    max(floor, max/max_ratio), renormalise, repeat", computed exactly: v_i = max(c*w_i, L) with sum 1, where
    L = max(floor, L_r) and L_r is the level at which the ratio alone binds. Order is preserved.
    """
    if not weights or any(not math.isfinite(x) or x <= 0 for x in weights):
        raise ValueError(f"weights must be a non-empty list of positive numbers, got {list(weights)}")
    if floor * len(weights) > 1.0 + 1e-12:
        raise ValueError(f"floor {floor} times {len(weights)} values exceeds 1")
    total = sum(weights)
    w = [x / total for x in weights]
    lifted = [max(x, max(w) / max_ratio) for x in w]
    scale = 1.0 / sum(lifted)
    if min(lifted) * scale >= floor:
        return [x * scale for x in lifted]
    ordered = sorted(w)
    for k, smallest in enumerate(ordered):
        c = (1.0 - k * floor) / sum(ordered[k:])
        if c * smallest >= floor:
            break
    return [max(c * x, floor) for x in w]


class StateController:
    """Samples user profiles from adaptive initial-state weights and updates the weights from outcomes."""

    def __init__(self, config: ControllerConfig, scenario: Scenario) -> None:
        if not isinstance(config, ControllerConfig):
            raise TypeError(f"config must be a ControllerConfig, got {type(config).__name__}")
        self.config, self.scenario = config, scenario
        self.schema = scenario.state_schema
        self._values: dict[str, list[int]] = {}
        for dim in self.schema.names:
            rng = scenario.state_ranges[dim]
            lo, hi = (rng.min, rng.max) if config.allow_extremes else (rng.min + 1, rng.max - 1)
            if lo > hi:
                raise ValueError(f"scenario {scenario.name}: {dim} range [{rng.min}, {rng.max}] has no value "
                                 "left without its extremes; set controller.allow_extremes")
            self._values[dim] = list(range(lo, hi + 1))
        if config.joint:
            combos = itertools.product(*(self._values[d] for d in self.schema.names))
            self._labels = {"joint": [self.schema.key(s) for s in combos]}
        else:
            self._labels = {dim: [str(v) for v in vals] for dim, vals in self._values.items()}
        for group, labels in self._labels.items():
            if config.floor * len(labels) > 1.0 + 1e-12:
                raise ValueError(f"controller.floor={config.floor} times {len(labels)} valid values of {group} "
                                 f"is {config.floor * len(labels):.3g} > 1; lower the floor")
        n_library = len(scenario.behaviors)
        if config.min_behaviors > n_library:
            raise ValueError(f"controller.min_behaviors={config.min_behaviors} exceeds the {n_library} behaviours "
                             f"of scenario {scenario.name}")
        self._weights = {g: [1.0 / len(labels)] * len(labels) for g, labels in self._labels.items()}
        self._rng = random.Random(config.seed)
        self.rules: RuleTable | None = None
        self.pool: ProfilePool | None = None
        if config.profile_source in ("rules", "pool"):
            self.rules = load_rule_table(config.rules_path)
            self.rules.check_library(scenario.behaviors, f"scenario {scenario.name}", scenario.dims)
        if config.profile_source == "pool":
            self.pool = ProfilePool.load(config.pool_path, scenario)
        self._pool_counts = {"draws": 0, "misses": 0}
        self._updates = 0
        self._last: dict[str, Any] = {"n": 0, "cr": None, "deviation": None, "value_cr": {}}

    @property
    def weights(self) -> dict[str, dict[str, float]]:
        """Current sampling weights: group (a dimension, or "joint") -> {label: weight}."""
        return {g: dict(zip(self._labels[g], w)) for g, w in self._weights.items()}

    def sample_states(self, n: int) -> list[tuple[int, ...]]:
        """Draw `n` initial states (values in dimension order) from the current weights."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"sampling needs an integer n >= 0, got {n!r}")
        if self.config.joint:
            return [self.schema.parse_key(self._rng.choices(self._labels["joint"], self._weights["joint"])[0])
                    for _ in range(n)]
        return [tuple(int(self._rng.choices(self._labels[d], self._weights[d])[0]) for d in self.schema.names)
                for _ in range(n)]

    def sample(self, n: int) -> list[UserProfile]:
        """Draw `n` profiles: an initial state from the weights, then behaviours per `profile_source`."""
        cfg, profiles = self.config, []
        for state in self.sample_states(n):
            if self.pool is not None:
                self._pool_counts["draws"] += 1
                written = self.pool.draw(self.schema.key(state), self._rng)
                if written is not None:
                    profiles.append(written)
                    continue
                self._pool_counts["misses"] += 1
                logger.debug("profile pool %s has no profile of state %s: drawing by the rules", self.pool.source,
                             self.schema.key(state))
            if self.rules is not None:
                behaviors = self.rules.sample(self.scenario.behaviors, state, self.scenario.state_ranges, self._rng,
                                              cfg.min_behaviors, cfg.max_behaviors)
            else:
                behaviors = sample_behaviors(self.scenario.behaviors, self._rng, cfg.min_behaviors,
                                             cfg.max_behaviors)
            profiles.append(self.scenario.profile(state, behaviors))
        return profiles

    def set_weights(self, weights: Mapping[str, Mapping[str, float]]) -> None:
        """Replace the sampling weights by `weights` ({group: {label: weight}}, as `weights` returns, e.g. a
        mistakes analysis's recommended weights); ValueError naming the group or label that does not fit."""
        new = {}
        for group, labels in self._labels.items():
            given = weights.get(group) if isinstance(weights, Mapping) else None
            if not isinstance(given, Mapping) or set(map(str, given)) != set(labels):
                raise ValueError(f"weights.{group} must give a weight to exactly {labels}, got "
                                 f"{sorted(map(str, given)) if isinstance(given, Mapping) else given!r}")
            by_label = {str(k): v for k, v in given.items()}
            values = [by_label[label] for label in labels]
            if any(isinstance(x, bool) or not isinstance(x, (int, float)) or not x >= 0 for x in values) or not sum(
                    values) > 0:
                raise ValueError(f"weights.{group} must be non-negative numbers with a positive sum, got {values}")
            new[group] = [float(x) / sum(values) for x in values]
        self._weights = new

    def _check_outcome(self, i: int, item: Any) -> tuple[tuple[int, ...], bool]:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ValueError(f"outcomes[{i}] must be a (state_key, completed) pair, got {item!r}")
        key, completed = item
        if not isinstance(completed, (bool, np.bool_)):
            raise ValueError(f"outcomes[{i}]: completed must be a bool, got {completed!r}")
        try:
            state = self.schema.parse_key(key)
        except ValueError as exc:
            raise ValueError(f"outcomes[{i}]: {exc}") from None
        for dim, value in zip(self.schema.names, state):
            rng = self.scenario.state_ranges[dim]
            if not rng.contains(value):
                raise ValueError(f"outcomes[{i}]: state_key {key!r} has {dim}={value} outside "
                                 f"[{rng.min}, {rng.max}] of scenario {self.scenario.name}")
        return state, bool(completed)

    def update(self, outcomes: Sequence[tuple[str, bool]]) -> dict[str, float]:
        """Re-weight from one (state_key, completed) pair per dialogue; returns `metrics()`.

        With no outcomes nothing changes (weights, update count and last-update statistics are kept).
        """
        parsed = [self._check_outcome(i, item) for i, item in enumerate(outcomes)]
        if not parsed:
            logger.info("controller: no outcomes this step, weights unchanged")
            return self.metrics()
        cfg = self.config
        cr = sum(done for _, done in parsed) / len(parsed)
        deviation = cr - cfg.target_completion_rate
        dims = self.schema.names
        tallies: dict[str, dict[str, list[int]]] = {g: {} for g in (*dims, "joint")}
        for state, done in parsed:
            for group, label in (*zip(dims, map(str, state)), ("joint", self.schema.key(state))):
                tally = tallies[group].setdefault(label, [0, 0])
                tally[0] += done
                tally[1] += 1
        for group, labels in self._labels.items():
            raw = [rule_weight(deviation, cfg.dead_band, *tallies[group].get(label, (0, 0))) for label in labels]
            target = [x / sum(raw) for x in raw]
            mixed = [(1.0 - cfg.smoothing) * old + cfg.smoothing * new
                     for old, new in zip(self._weights[group], target)]
            self._weights[group] = bound_weights(mixed, cfg.floor, cfg.max_ratio)
        self._updates += 1
        self._last = {"n": len(parsed), "cr": cr, "deviation": deviation,
                      "value_cr": {f"{dim}={label}": done / count for dim in dims
                                   for label, (done, count) in sorted(tallies[dim].items())}}
        logger.info("controller update %d: n=%d cr=%.3f (target %.3f, deviation %+.3f) weights %s",
                    self._updates, len(parsed), cr, cfg.target_completion_rate, deviation,
                    {g: {k: round(v, 4) for k, v in w.items()} for g, w in self.weights.items()})
        return self.metrics()

    def metrics(self) -> dict[str, float]:
        """Weights (marginal per dimension value; also per combination when joint), last update's CRs and n."""
        out: dict[str, float] = {"controller/updates": float(self._updates), "controller/n": float(self._last["n"])}
        if self._last["cr"] is not None:
            out["controller/cr"] = self._last["cr"]
            out["controller/deviation"] = self._last["deviation"]
        if self.config.joint:
            joint = self.weights["joint"]
            for i, dim in enumerate(self.schema.names):
                for v in self._values[dim]:
                    out[f"controller/weight/{dim}={v}"] = sum(w for k, w in joint.items()
                                                              if self.schema.parse_key(k)[i] == v)
            out.update({f"controller/weight/{k}": w for k, w in joint.items()})
        else:
            out.update({f"controller/weight/{dim}={k}": w for dim in self.schema.names
                        for k, w in self.weights[dim].items()})
        out.update({f"controller/cr/{k}": v for k, v in self._last["value_cr"].items()})
        if self.pool is not None:
            draws = self._pool_counts["draws"]
            out["controller/pool_miss_rate"] = self._pool_counts["misses"] / draws if draws else 0.0
        return out

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: weights, RNG state, update count and the last update's statistics."""
        version, internal, gauss = self._rng.getstate()
        return {"version": _STATE_VERSION, "joint": self.config.joint,
                "labels": {g: list(v) for g, v in self._labels.items()},
                "weights": {g: list(w) for g, w in self._weights.items()},
                "rng": [version, list(internal), gauss], "updates": self._updates,
                "last": {**self._last, "value_cr": dict(self._last["value_cr"])},
                "pool": dict(self._pool_counts)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from `state_dict()`; ValueError naming the key when it does not fit this controller."""
        if not isinstance(state, Mapping):
            raise ValueError(f"controller state must be a mapping, got {type(state).__name__}")
        missing = {"version", "joint", "labels", "weights", "rng", "updates", "last"} - set(state)
        if missing:
            raise ValueError(f"controller state is missing key(s) {sorted(missing)}")
        if state["version"] != _STATE_VERSION:
            raise ValueError(f"controller state version {state['version']!r} != {_STATE_VERSION}")
        if state["joint"] != self.config.joint or state["labels"] != self._labels:
            raise ValueError("controller state 'labels' were saved with another scenario range, joint or "
                             "allow_extremes setting than this controller's")
        weights = {}
        saved = state["weights"] if isinstance(state["weights"], Mapping) else {}
        for group, labels in self._labels.items():
            w = saved.get(group)
            if (not isinstance(w, list) or len(w) != len(labels)
                    or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not x >= 0 for x in w)
                    or not math.isclose(sum(w), 1.0, abs_tol=1e-6)):
                raise ValueError(f"controller state 'weights.{group}' must be {len(labels)} non-negative numbers "
                                 "summing to 1")
            weights[group] = [float(x) for x in w]
        last = state["last"]
        if (isinstance(state["updates"], bool) or not isinstance(state["updates"], int) or not isinstance(last, Mapping)
                or set(last) != {"n", "cr", "deviation", "value_cr"} or not isinstance(last["value_cr"], Mapping)):
            raise ValueError("controller state 'updates' must be an integer and 'last' hold n, cr, deviation, "
                             "value_cr")
        try:
            version, internal, gauss = state["rng"]
            self._rng.setstate((version, tuple(internal), gauss))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"controller state 'rng' is not a saved random.Random state: {exc}") from None
        self._weights = weights
        self._updates = state["updates"]
        self._last = {**last, "value_cr": dict(last["value_cr"])}
        pool = state.get("pool") or {}
        self._pool_counts = {k: int(pool.get(k, 0)) for k in ("draws", "misses")}
