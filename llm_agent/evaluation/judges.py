"""Cross-judge evaluation: one agent graded by several simulator sets (judges) on the same profiles and seeds.

A judge is `NAME=URLS` (`--judge` of for_evaluation/evaluate.py): a name of letters, digits, `_` and `-` (it
names a directory and a table row) and the base URLs of its simulator instances, comma-separated and checked
like `--user-sim-urls`. Each agent's dialogues under judge J go to `<out>/J/` exactly as a one-judge evaluation
writes them (`<name>_dialogues.jsonl`, `<name>_results.json`, resumable per judge); `cross_judge_table` then puts
every (agent, judge) side by side with the metrics table of `llm_agent.evaluation.table` (rows `agent@judge`,
intervals of `llm_agent.evaluation.stats`) and pairs the same agent's dialogues under two judges by dialogue id
and profile: the CR difference with its paired interval and the dialogues only one judge let complete.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from itertools import combinations
from pathlib import Path
from typing import Any

from llm_agent.evaluation.table import ComparisonTable, build_table, load_evaluation
from llm_agent.rollout.judges import parse_judge_urls

__all__ = ["Judge", "cross_judge_summary", "cross_judge_table", "judge_dir", "parse_judges", "write_summary"]


@dataclass(frozen=True)
class Judge:
    """A named set of simulator instances that grades an agent."""

    name: str
    urls: tuple[str, ...]


def parse_judges(specs: list[str]) -> list[Judge]:
    """The judges of `--judge NAME=URLS` arguments; ValueError on a missing `=`, a bad or repeated name or a bad
    URL."""
    judges: list[Judge] = []
    for spec in specs:
        name, sep, urls = spec.partition("=")
        if not sep:
            raise ValueError(f"--judge {spec!r}: expected NAME=URL[,URL...]")
        if any(j.name == name for j in judges):
            raise ValueError(f"--judge {name!r} is given twice; judge names must differ")
        judges.append(Judge(name, tuple(parse_judge_urls({name: urls}, "--judge")[name])))
    return judges


def judge_dir(out_dir: str | Path, judge: str) -> Path:
    """Where the dialogues and results under `judge` go: `<out>/<judge>/`."""
    return Path(out_dir) / judge


def cross_judge_table(out_dir: str | Path, agents: list[str], judges: list[str], n_resamples: int,
                      confidence: float, seed: int) -> ComparisonTable:
    """Every agent under every judge (rows `agent@judge`, read from `<out>/<judge>/<agent>_results.json`) and the
    paired comparisons of each agent between every two judges."""
    evals = [load_evaluation(judge_dir(out_dir, judge) / f"{agent}_results.json", name=f"{agent}@{judge}")
             for agent in agents for judge in judges]
    table = build_table(evals, n_resamples, confidence, seed)
    wanted = {(f"{agent}@{a}", f"{agent}@{b}") for agent in agents for a, b in combinations(judges, 2)}
    return replace(table, pairs=[pair for pair in table.pairs if (pair[0], pair[1]) in wanted])


def cross_judge_summary(table: ComparisonTable) -> dict[str, Any]:
    """The table as JSON: per `agent@judge` its dialogue count and metric intervals; per judge pair the paired
    comparison (`only_a_completed` = dialogues only the first judge let complete)."""
    return {"confidence": table.confidence, "n_resamples": table.n_resamples,
            "rows": {name: {"n_dialogues": n, "metrics": {k: v.to_dict() for k, v in m.items()}}
                     for name, n, m in zip(table.names, table.counts, table.metrics)},
            "pairs": [{"a": a, "b": b, **c.to_dict()} for a, b, c in table.pairs]}


def write_summary(path: Path, table: ComparisonTable) -> None:
    """`cross_judge_summary(table)` as indented JSON at `path`."""
    path.write_text(json.dumps(cross_judge_summary(table), indent=2) + "\n")
