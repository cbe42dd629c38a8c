"""The options of rollout correction as veRL (0.9.x) spells them, parsed and checked.

``rollout_is``: the unit one importance ratio is taken over: ``token``, ``sequence`` (veRL) or ``turn`` (SEAD:
one agent turn of a dialogue). ``rollout_is_threshold``: a positive number (TIS: weights above it are truncated
to it) or a ``"lower_upper"`` string (IcePop: weights outside [lower, upper] are zeroed).

``rollout_rs``: comma-separated rejection options ``<level>_<aggregate>_<estimator>`` (``token_k1``,
``seq_sum_k3``, ``seq_mean_k1``, ``seq_max_k2``, ...; SEAD adds the ``turn_*`` family), every one of which a
token (or its whole sequence / turn) must pass. The estimators of the per-token log-ratio ``l = log(pi_train /
pi_rollout)``, clamped to +-20: ``k1 = -l``, ``k2 = l^2 / 2``, ``k3 = exp(l) - 1 - l``. ``rollout_rs_threshold``:
one spec per option, or one shared by all; ``k1`` options take ratio bounds ``"lower_upper"`` (a single number
``u`` means ``1/u .. u``) and keep a unit when ``log(lower) <= statistic <= log(upper)``; ``k2``/``k3`` options
take one positive upper bound on the statistic.

Every number must be finite and positive (veRL also accepts ``inf``/``nan`` strings); a ``lower_upper`` spec has
exactly two numbers without further underscores.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

__all__ = ["IS_LEVELS", "RejectionOption", "SUPPORTED_ROLLOUT_RS_OPTIONS", "TOKEN_LEVEL_ROLLOUT_RS_OPTIONS",
           "parse_rollout_is_threshold", "parse_rollout_rs", "parse_rollout_rs_thresholds", "rejection_options"]

IS_LEVELS = ("token", "turn", "sequence")
_AGGREGATES = {"sum": ("k1", "k2", "k3"), "mean": ("k1", "k2", "k3"), "max": ("k2", "k3")}
TOKEN_LEVEL_ROLLOUT_RS_OPTIONS = frozenset({"token_k1", "token_k2", "token_k3"})
SUPPORTED_ROLLOUT_RS_OPTIONS = TOKEN_LEVEL_ROLLOUT_RS_OPTIONS | frozenset(
    f"{level}_{aggregate}_{estimator}"
    for level in ("seq", "turn") for aggregate, estimators in _AGGREGATES.items() for estimator in estimators)

Threshold = Union[str, float, int]


@dataclass(frozen=True)
class RejectionOption:
    """One ``rollout_rs`` option with its bounds on the statistic (k1: in log-ratio space; k2/k3: ``low`` None)."""

    name: str
    level: str  # token | turn | sequence
    aggregate: Optional[str]  # None (token level) | sum | mean | max
    estimator: str  # k1 | k2 | k3
    low: Optional[float]
    high: float


def _number(text: str, what: str) -> float:
    """A finite positive number from ``text``; ValueError naming ``what`` otherwise."""
    text = text.strip()
    if "_" in text:
        raise ValueError(f"{what}: {text!r} is not a number (a bound takes no underscore)")
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what}: bounds must be finite and positive, got {text!r}")
    return value


def _bounds(spec: str, what: str) -> tuple[float, float]:
    """``(lower, upper)`` of a ``"lower_upper"`` spec."""
    parts = spec.split("_")
    if len(parts) != 2:
        raise ValueError(f"{what}: {spec!r} must be one number or 'lower_upper'")
    lower, upper = _number(parts[0], what), _number(parts[1], what)
    if lower > upper:
        raise ValueError(f"{what}: lower bound {lower} is above upper bound {upper} in {spec!r}")
    return lower, upper


def _spec_text(spec: Threshold, what: str) -> str:
    if isinstance(spec, bool) or not isinstance(spec, (str, int, float)):
        raise TypeError(f"{what} must be a number or a string such as '0.5_2.0', got {spec!r}")
    text = repr(float(spec)) if isinstance(spec, (int, float)) else spec.strip()
    if not text:
        raise ValueError(f"{what} must not be empty")
    return text


def parse_rollout_is_threshold(spec: Threshold) -> tuple[float, Optional[float]]:
    """``(upper, lower)`` of ``rollout_is_threshold``: lower is None for a single number (TIS), set for a
    ``"lower_upper"`` string (IcePop)."""
    text = _spec_text(spec, "rollout_is_threshold")
    if "_" in text:
        lower, upper = _bounds(text, "rollout_is_threshold")
        return upper, lower
    return _number(text, "rollout_is_threshold"), None


def parse_rollout_rs(rollout_rs: str) -> list[str]:
    """The distinct options of a comma-separated ``rollout_rs`` string, in order; ValueError on an unknown one."""
    if not isinstance(rollout_rs, str):
        raise ValueError(f"rollout_rs must be a comma-separated string of options, got {rollout_rs!r}")
    options: list[str] = []
    for option in (part.strip() for part in rollout_rs.split(",")):
        if not option:
            continue
        if option not in SUPPORTED_ROLLOUT_RS_OPTIONS:
            raise ValueError(f"rollout_rs option {option!r} is not one of {sorted(SUPPORTED_ROLLOUT_RS_OPTIONS)}")
        if option not in options:
            options.append(option)
    if not options:
        raise ValueError("rollout_rs must name at least one option (or be null)")
    return options


def parse_rollout_rs_thresholds(options: list[str],
                                spec: Optional[Threshold]) -> dict[str, dict[str, Optional[float]]]:
    """``{option: {"lower", "upper"}}`` in the units the user wrote them (ratios for k1, statistics for k2/k3),
    as veRL returns them; one spec per option or one for all."""
    if spec is None:
        raise ValueError("rollout_rs_threshold must be set when rollout_rs is")
    text = _spec_text(spec, "rollout_rs_threshold")
    specs = [part.strip() for part in text.split(",") if part.strip()]
    if len(specs) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold has {len(specs)} entries for {len(options)} rollout_rs options "
                         f"{options}: give one shared threshold or one per option")
    specs = specs * len(options) if len(specs) == 1 else specs
    out: dict[str, dict[str, Optional[float]]] = {}
    for option, entry in zip(options, specs):
        what = f"rollout_rs_threshold for {option}"
        if option.endswith("k1"):
            if "_" in entry:
                lower, upper = _bounds(entry, what)
            else:
                upper = _number(entry, what)
                lower = 1.0 / upper
                if lower > upper:
                    raise ValueError(f"{what}: a single ratio bound must be >= 1 (it means 1/u .. u), got {entry!r}")
            out[option] = {"lower": lower, "upper": upper}
        else:
            if "_" in entry:
                raise ValueError(f"{what}: k2/k3 options take one upper bound, got {entry!r}")
            out[option] = {"lower": None, "upper": _number(entry, what)}
    return out


def rejection_options(rollout_rs: str, rollout_rs_threshold: Optional[Threshold]) -> list[RejectionOption]:
    """The parsed options of ``rollout_rs`` with their bounds on the statistic."""
    names = parse_rollout_rs(rollout_rs)
    thresholds = parse_rollout_rs_thresholds(names, rollout_rs_threshold)
    parsed = []
    for name in names:
        parts = name.split("_")
        level = {"token": "token", "seq": "sequence", "turn": "turn"}[parts[0]]
        aggregate = parts[1] if len(parts) == 3 else None
        estimator = parts[-1]
        bounds = thresholds[name]
        if estimator == "k1":
            low, high = math.log(bounds["lower"]), math.log(bounds["upper"])
        else:
            low, high = None, float(bounds["upper"])
        parsed.append(RejectionOption(name, level, aggregate, estimator, low, high))
    return parsed
