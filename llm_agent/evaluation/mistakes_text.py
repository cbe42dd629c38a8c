"""The mistakes analysis (`analysis.analyze_by_split`'s result) as a short text a person reads in a terminal:
per split the outcome counts, the CR, the hardest and easiest state combinations, the behaviour categories and
where failed calls ended and why (their most common failure labels). Intervals are Wilson 95% intervals, written `[low, high]`."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llm_agent.metrics import NOT_AVAILABLE

__all__ = ["mistakes_summary"]


def _rate(r: Mapping[str, Any]) -> str:
    if not r["n"]:
        return f"CR {NOT_AVAILABLE} (0 dialogues)"
    return f"CR {r['cr']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}] ({r['completed']}/{r['n']})"


def _split_lines(name: str, a: Mapping[str, Any], top: int) -> list[str]:
    outcomes = ", ".join(f"{o} {n}" for o, n in a["outcomes"].items() if n)
    lines = [f"{name}: {a['n_dialogues']} dialogues ({a['n_errors']} simulator errors, left out of every CR); "
             f"{_rate(a['completion'])}", f"  outcomes: {outcomes or 'none'}"]
    for key, title in (("hardest", "hardest"), ("easiest", "easiest")):
        rows = a[key][:top]
        lines.append(f"  {title} initial states (>= {a['min_count']} dialogues): "
                     + ("; ".join(f"{r['state_key']} {_rate(r)}" for r in rows) if rows else "none with enough dialogues"))
    categories = a["by_behavior_category"][:top]
    if categories:
        lines.append("  behaviour categories, lowest CR first: "
                     + "; ".join(f"{r['category']} {_rate(r)}" for r in categories))
    failures = a["failures"]
    if failures["n"]:
        stages = "; ".join(f"{r['name']} {r['share']:.0%}" for r in failures["by_stage"][:top])
        lines.append(f"  {failures['n']} failed calls ended at (highest stage reached): {stages}")
    labels = [row for row in (a.get("diagnosis") or {}).get("labels", ()) if row["dialogues"]]
    if labels:
        lines.append("  why they failed (share of failed calls with the label): "
                     + "; ".join(f"{row['label']} {row['share']:.0%}"
                                 for row in sorted(labels, key=lambda row: -row["share"])[:top]))
    return lines


def mistakes_summary(result: Mapping[str, Any], top: int = 5) -> str:
    """Several lines per split of `result` (`{"scenario", "splits", ...}`), at most `top` rows per ranking."""
    lines = [f"scenario {result['scenario']} (brackets: Wilson 95% intervals; CR over non-error dialogues)"]
    for name, analysis in result["splits"].items():
        lines += _split_lines(name, analysis, top)
    return "\n".join(lines)
