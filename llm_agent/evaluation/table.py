"""The paper table: the headline dialogue metrics of several evaluated agents side by side, with bootstrap CIs,
and paired tests of the completion-rate difference between agents evaluated on the same profiles.

Inputs are evaluations' `<name>_results.json` (their dialogues file beside them is read) or dialogue logs
(`<name>_dialogues.jsonl`, or a training run's `rollouts.jsonl` with a split and step chosen). Metrics are always
recomputed from the dialogues with `llm_agent.metrics.dialogue_metrics`, so every column follows the current
definitions there; CIs and tests are those of `llm_agent.evaluation.stats`.
"""
from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Any

from llm_agent.evaluation.dialogue_log import latest_per_dialogue, read_dialogue_log
from llm_agent.evaluation.stats import (DEFAULT_CONFIDENCE, DEFAULT_RESAMPLES, Interval, PairedComparison,
                                        metric_intervals, paired_comparison)
from llm_agent.rollout.config import resolve_path
from llm_agent.scenario import Scenario, load_scenario

__all__ = ["COLUMNS", "AgentEval", "ComparisonTable", "build_table", "load_evaluation", "render"]

# (column header, dialogue_metrics key, what it is) in the paper's order.
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("CR", "completion_rate", "completion rate"),
    ("FPR", "false_positive_rate", "false-positive rate of the agent's 'done' claims"),
    ("SCR", "stage_completeness", "stage completeness rate (no SOP stage skipped)"),
    ("ATT", "att", "average turns to target (completed dialogues)"),
    ("ADT", "adt", "average dialogue turns"),
    ("UPA", "upa", "user portrait accuracy"),
    ("EI", "ei", "emotion improvement"),
    ("TI", "ti", "trust improvement"),
    ("CI", "ci", "cooperation improvement"),
)
FORMATS = ("terminal", "markdown", "csv", "latex")


@dataclass
class AgentEval:
    """One evaluated agent: its name, its scenario and its dialogue records."""

    name: str
    scenario: Scenario
    records: list[dict[str, Any]]
    source: Path


def _select(records: list[dict[str, Any]], path: Path, split: str | None, step: int | None) -> list[dict[str, Any]]:
    """The records of one split and step (defaults: `eval` if present, else `val`; the last step)."""
    splits = {r.get("split") for r in records}
    if split is None:
        split = "eval" if "eval" in splits else "val" if "val" in splits else None
        if split is None:
            raise ValueError(f"{path}: no eval or val dialogues (splits {sorted(map(str, splits))}); pass --split")
    chosen = [r for r in records if r.get("split") == split]
    if not chosen:
        raise ValueError(f"{path}: no dialogues of split {split!r} (splits {sorted(map(str, splits))})")
    steps = sorted({r.get("step") for r in chosen if isinstance(r.get("step"), int)})
    target = step if step is not None else (steps[-1] if steps else None)
    if step is not None and step not in steps:
        raise ValueError(f"{path}: split {split!r} has no step {step} (steps {steps})")
    if len(steps) > 1 or step is not None:
        chosen = [r for r in chosen if r.get("step") == target]
    return list(latest_per_dialogue(chosen).values())


def load_evaluation(path: str | Path, scenario_path: str | None = None, split: str | None = None,
                    step: int | None = None, name: str | None = None) -> AgentEval:
    """An `AgentEval` from a results JSON (scenario from it unless given) or a dialogue log (needs a scenario)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    if path.suffix == ".json":
        try:
            results = json.loads(path.read_text())
            log_path = path.parent / results["dialogues_file"]
            scenario_path = scenario_path or results["scenario"]
            name = name or results["name"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not an evaluation results file ({exc!r})") from None
    else:
        log_path = path
        stem = path.stem
        name = name or (stem[:-len("_dialogues")] if stem.endswith("_dialogues") else
                        path.parent.name if stem == "rollouts" else stem)
    if not scenario_path:
        raise ValueError(f"{path}: a dialogue log does not name its scenario; pass --scenario")
    resolved = resolve_path(scenario_path)  # the working directory, then the repository root
    if resolved is None:
        raise ValueError(f"{path}: scenario file {scenario_path!r} not found")
    records = _select(read_dialogue_log(log_path).records, log_path, split, step)
    return AgentEval(name=name, scenario=load_scenario(resolved), records=records, source=log_path)


@dataclass
class ComparisonTable:
    """Per agent its dialogue count and an Interval per column key; per compared pair its PairedComparison."""

    names: list[str]
    counts: list[int]
    metrics: list[dict[str, Interval]]
    pairs: list[tuple[str, str, PairedComparison]]
    confidence: float
    n_resamples: int


def build_table(evals: list[AgentEval], n_resamples: int = DEFAULT_RESAMPLES,
                confidence: float = DEFAULT_CONFIDENCE, seed: int = 0) -> ComparisonTable:
    """Metrics with CIs for every agent and a paired comparison for every pair sharing profiles."""
    names = [e.name for e in evals]
    if len(set(names)) != len(names):
        raise ValueError(f"agent names must differ, got {names} (pass --name per input)")
    metrics = [metric_intervals(e.records, e.scenario, n_resamples, confidence, seed) for e in evals]
    pairs = []
    for a, b in combinations(evals, 2):
        if a.scenario.name != b.scenario.name:
            continue
        comparison = paired_comparison(a.records, b.records, a.scenario, n_resamples, confidence, seed)
        if comparison is not None:
            pairs.append((a.name, b.name, comparison))
    return ComparisonTable(names, [len(e.records) for e in evals], metrics, pairs, confidence, n_resamples)


def _cell(interval: Interval, digits: int) -> str:
    return f"{interval.value:.{digits}f} [{interval.low:.{digits}f}, {interval.high:.{digits}f}]"


def _grid(table: ComparisonTable, digits: int) -> tuple[list[str], list[list[str]]]:
    header = ["agent", "N", *(c for c, _, _ in COLUMNS)]
    rows = [[name, str(n), *(_cell(m[key], digits) for _, key, _ in COLUMNS)]
            for name, n, m in zip(table.names, table.counts, table.metrics)]
    return header, rows


def _pair_grid(table: ComparisonTable, digits: int) -> tuple[list[str], list[list[str]]]:
    header = ["A vs B", "pairs", "CR(A)-CR(B)", "only A done", "only B done", "McNemar exact p"]
    rows = [[f"{a} vs {b}", str(c.n_pairs), _cell(c.cr_difference, digits), str(c.only_a_completed),
             str(c.only_b_completed), f"{c.mcnemar_p:.4g}"] for a, b, c in table.pairs]
    return header, rows


def _aligned(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, rows)])


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                      *("| " + " | ".join(r) + " |" for r in rows)])


def _legend(table: ComparisonTable) -> str:
    level = f"{table.confidence:.0%}"
    return (f"value [{level} CI]: percentile bootstrap over dialogues, {table.n_resamples} resamples. "
            + "; ".join(f"{c} = {text}" for c, _, text in COLUMNS)
            + ". Pairs: same dialogue id and profile; CR difference with a paired bootstrap CI; McNemar's exact "
            "test (two-sided binomial on discordant pairs, pairs with an error dialogue left out).")


def _latex_escape(text: str) -> str:
    for char in "\\&%$#_{}":
        text = text.replace(char, "\\" + char)
    return text


def render(table: ComparisonTable, fmt: str, digits: int = 3) -> str:
    """The table as `terminal` text, `markdown`, `csv` (value, low, high per metric) or `latex` rows."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    header, rows = _grid(table, digits)
    pair_header, pair_rows = _pair_grid(table, digits)
    if fmt == "terminal":
        parts = [_aligned(header, rows)]
        if pair_rows:
            parts.append(_aligned(pair_header, pair_rows))
        return "\n\n".join([*parts, _legend(table)]) + "\n"
    if fmt == "markdown":
        parts = [_markdown(header, rows)]
        if pair_rows:
            parts.append(_markdown(pair_header, pair_rows))
        return "\n\n".join([*parts, _legend(table)]) + "\n"
    if fmt == "csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(["agent", "n_dialogues", *(f"{c}_{part}" for c, _, _ in COLUMNS for part in ("value", "low", "high"))])
        for name, n, m in zip(table.names, table.counts, table.metrics):
            writer.writerow([name, n, *(repr(getattr(m[key], part)) for _, key, _ in COLUMNS
                                        for part in ("value", "low", "high"))])
        return buffer.getvalue()
    lines = [f"% agent & N & {' & '.join(c for c, _, _ in COLUMNS)} \\\\ ({table.confidence:.0%} bootstrap CIs)"]
    for name, n, m in zip(table.names, table.counts, table.metrics):
        cells = [f"{m[key].value:.{digits}f}\\,{{\\scriptsize[{m[key].low:.{digits}f}, {m[key].high:.{digits}f}]}}"
                 for _, key, _ in COLUMNS]
        lines.append(f"{_latex_escape(name)} & {n} & " + " & ".join(cells) + " \\\\")
    for a, b, c in table.pairs:
        d = c.cr_difference
        lines.append(f"% {_latex_escape(a)} vs {_latex_escape(b)}: $\\Delta$CR = {d.value:.{digits}f} "
                     f"[{d.low:.{digits}f}, {d.high:.{digits}f}], McNemar exact $p$ = {c.mcnemar_p:.4g} "
                     f"({c.n_pairs} pairs)")
    return "\n".join(lines) + "\n"
