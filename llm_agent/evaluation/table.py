"""The paper table: the headline dialogue metrics of several evaluated agents side by side, with bootstrap
intervals, what their dialogues cost, and paired tests of the completion-rate difference between agents evaluated
on the same profiles.

Inputs are evaluations' `<name>_results.json` (their dialogues file beside them is read) or dialogue logs
(`<name>_dialogues.jsonl`, or a training run's `rollouts.jsonl` with a split and step chosen). Metrics are always
recomputed from the dialogues with `llm_agent.metrics`, so every column follows the current definitions there;
intervals and tests are those of `llm_agent.evaluation.stats`. An undefined metric (ATT with no completed call)
prints as "n/a", and an interval over fewer resamples than asked (the metric was undefined on the others) carries
a `*` explained under the table. After UPA come the improvement indices of the scenario's state dimensions, in its
order (for the shipped scenarios CI, EI, TI: the cooperation, emotion and trust improvements of the paper); the
agents of one table share a scenario's dimensions. Confidence intervals are called intervals. The cost columns are
per 1,000 dialogues: agent tokens generated, simulator requests and wall seconds (measured where the dialogues
ran).
"""
from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Any

from llm_agent.evaluation.defaults import DEFAULT_CONFIDENCE, DEFAULT_RESAMPLES, TABLE_FORMATS
from llm_agent.evaluation.dialogue_log import latest_per_dialogue, read_dialogue_log
from llm_agent.evaluation.stats import Interval, PairedComparison, metric_intervals, paired_comparison
from llm_agent.metrics import NOT_AVAILABLE, index_keys
from llm_agent.rollout.config import resolve_path
from llm_agent.rollout.dialogue_record import DialogueRecord
from llm_agent.scenario import Scenario, load_scenario

__all__ = ["BASE_COLUMNS", "COST_COLUMNS", "FORMATS", "AgentEval", "ComparisonTable", "build_table", "columns_of",
           "load_evaluation", "render"]

Column = tuple[str, str, str]  # (column header, dialogue_metrics key, what it is)
# the paper's columns before the improvement indices
BASE_COLUMNS: tuple[Column, ...] = (
    ("CR", "completion_rate", "completion rate"),
    ("FPR", "false_positive_rate", "false-positive rate of the agent's 'done' claims"),
    ("SCR", "stage_completeness", "stage completeness rate (no SOP stage skipped)"),
    ("ATT", "att", "average turns to target (completed dialogues)"),
    ("ADT", "adt", "average dialogue turns"),
    ("UPA", "upa", "user portrait accuracy"),
)


def columns_of(scenario: Scenario) -> tuple[Column, ...]:
    """The table's metric columns for `scenario`: the base ones, then one improvement index per dimension."""
    return (*BASE_COLUMNS, *((key.upper(), key, f"{dim} improvement") for key, dim in index_keys(scenario).items()))
# (column header, dialogue_metrics key of the per-dialogue mean, what it is): shown per 1,000 dialogues
COST_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("tokens/1k", "agent_tokens_per_dialogue", "agent tokens generated"),
    ("sim calls/1k", "sim_requests_per_dialogue", "simulator requests (re-requests included)"),
    ("s/1k", "seconds_per_dialogue", "wall seconds of the rollout calls, on the machine and with the concurrency "
                                     "they ran with"),
)
PER = 1000  # the cost columns are per this many dialogues
FORMATS = TABLE_FORMATS
MARK = "*"  # an interval over fewer resamples than asked


@dataclass
class AgentEval:
    """One evaluated agent: its name, its scenario and its dialogue records."""

    name: str
    scenario: Scenario
    records: list[DialogueRecord]
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
    records = [DialogueRecord.from_dict(r, f"{log_path}: dialogue {r.get('dialogue_id')!r}")
               for r in _select(read_dialogue_log(log_path).records, log_path, split, step)]
    return AgentEval(name=name, scenario=load_scenario(resolved), records=records, source=log_path)


@dataclass
class ComparisonTable:
    """Per agent its dialogue count and an Interval per metric key; per compared pair its PairedComparison; the
    metric columns shown (`columns_of` the agents' scenario)."""

    names: list[str]
    counts: list[int]
    metrics: list[dict[str, Interval]]
    pairs: list[tuple[str, str, PairedComparison]]
    confidence: float
    n_resamples: int
    columns: tuple[Column, ...] = BASE_COLUMNS


def build_table(evals: list[AgentEval], n_resamples: int = DEFAULT_RESAMPLES,
                confidence: float = DEFAULT_CONFIDENCE, seed: int = 0) -> ComparisonTable:
    """Metrics with intervals for every agent and a paired comparison for every pair sharing profiles."""
    names = [e.name for e in evals]
    if len(set(names)) != len(names):
        raise ValueError(f"agent names must differ, got {names} (pass --name per input)")
    columns = {columns_of(e.scenario) for e in evals}
    if len(columns) > 1:
        dims = sorted(e.scenario.dims for e in evals)
        raise ValueError(f"the agents' scenarios have different state dimensions ({dims}); tabulate them separately")
    metrics = [metric_intervals(e.records, e.scenario, n_resamples, confidence, seed) for e in evals]
    pairs = []
    for a, b in combinations(evals, 2):
        if a.scenario.name != b.scenario.name:
            continue
        comparison = paired_comparison(a.records, b.records, a.scenario, n_resamples, confidence, seed)
        if comparison is not None:
            pairs.append((a.name, b.name, comparison))
    return ComparisonTable(names, [len(e.records) for e in evals], metrics, pairs, confidence, n_resamples,
                           columns.pop() if columns else BASE_COLUMNS)


def _cell(interval: Interval, digits: int, n_resamples: int) -> str:
    """`value [low, high]`, `*` when over fewer resamples than asked; n/a when undefined."""
    if interval.value is None:
        return NOT_AVAILABLE
    if interval.low is None or interval.high is None:
        return f"{interval.value:.{digits}f} [{NOT_AVAILABLE}]"
    mark = MARK if interval.resamples < n_resamples else ""
    return f"{interval.value:.{digits}f} [{interval.low:.{digits}f}, {interval.high:.{digits}f}]{mark}"


def _per_thousand(interval: Interval) -> float | None:
    return None if interval.value is None else PER * interval.value


def _compact(value: float | None) -> str:
    """A cost figure in a few characters: 812, 4.31k, 52.3k, 1.20M; n/a when unknown."""
    if value is None:
        return NOT_AVAILABLE
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            scaled = value / scale
            return f"{scaled:.3g}{suffix}" if scaled < 100 else f"{scaled:.0f}{suffix}"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def _grid(table: ComparisonTable, digits: int) -> tuple[list[str], list[list[str]]]:
    header = ["agent", "N", *(c for c, _, _ in table.columns), *(c for c, _, _ in COST_COLUMNS)]
    rows = [[name, str(n), *(_cell(m[key], digits, table.n_resamples) for _, key, _ in table.columns),
             *(_compact(_per_thousand(m[key])) for _, key, _ in COST_COLUMNS)]
            for name, n, m in zip(table.names, table.counts, table.metrics)]
    return header, rows


def _pair_grid(table: ComparisonTable, digits: int) -> tuple[list[str], list[list[str]]]:
    header = ["A vs B", "pairs", "CR(A)-CR(B)", "only A done", "only B done", "McNemar exact p"]
    rows = [[f"{a} vs {b}", str(c.n_pairs), _cell(c.cr_difference, digits, table.n_resamples),
             str(c.only_a_completed), str(c.only_b_completed), f"{c.mcnemar_p:.4g}"] for a, b, c in table.pairs]
    return header, rows


def _aligned(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, rows)])


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                      *("| " + " | ".join(r) + " |" for r in rows)])


def _fewer_resamples(table: ComparisonTable) -> list[str]:
    """`<agent> <column> <k>/<n>` for every shown interval taken over fewer resamples than asked."""
    notes = [f"{name} {column} {m[key].resamples}/{table.n_resamples}"
             for name, m in zip(table.names, table.metrics) for column, key, _ in table.columns
             if m[key].value is not None and m[key].resamples < table.n_resamples]
    notes += [f"{a} vs {b} {c.cr_difference.resamples}/{table.n_resamples}" for a, b, c in table.pairs
              if c.cr_difference.value is not None and c.cr_difference.resamples < table.n_resamples]
    return notes


def _legend(table: ComparisonTable) -> str:
    level = f"{table.confidence:.0%}"
    fewer = _fewer_resamples(table)
    return (f"value [{level} interval]: percentile bootstrap over dialogues, {table.n_resamples} resamples"
            + (f"; {MARK} over the resamples on which the metric is defined ({', '.join(fewer)})" if fewer else "")
            + f"; {NOT_AVAILABLE}: undefined on these dialogues (ATT needs a completed call, FPR a claim of success, "
            "UPA a turn with both states). "
            + "; ".join(f"{c} = {text}" for c, _, text in table.columns)
            + f". Cost per {PER:,} dialogues: " + "; ".join(f"{c} = {text}" for c, _, text in COST_COLUMNS)
            + ". Pairs: same dialogue id and profile; CR difference with a paired bootstrap interval; McNemar's "
            "exact test (two-sided binomial on discordant pairs, pairs with an error dialogue left out).")


def _latex_escape(text: str) -> str:
    for char in "\\&%$#_{}":
        text = text.replace(char, "\\" + char)
    return text


def _latex_cell(interval: Interval, digits: int, n_resamples: int) -> str:
    if interval.value is None:
        return "n/a"
    if interval.low is None or interval.high is None:
        return f"{interval.value:.{digits}f}"
    mark = "$^*$" if interval.resamples < n_resamples else ""
    return (f"{interval.value:.{digits}f}\\,{{\\scriptsize[{interval.low:.{digits}f}, "
            f"{interval.high:.{digits}f}]}}{mark}")


def _latex_tabular(header: list[str], rows: list[list[str]], align: str) -> list[str]:
    """A complete `tabular` environment (no package needed: \\hline rules)."""
    return [f"\\begin{{tabular}}{{{align}}}", "\\hline", " & ".join(header) + " \\\\", "\\hline",
            *(" & ".join(r) + " \\\\" for r in rows), "\\hline", "\\end{tabular}"]


def _latex(table: ComparisonTable, digits: int) -> str:
    header = ["Agent", "N", *(c for c, _, _ in table.columns), *(_latex_escape(c) for c, _, _ in COST_COLUMNS)]
    rows = [[_latex_escape(name), str(n),
             *(_latex_cell(m[key], digits, table.n_resamples) for _, key, _ in table.columns),
             *(_compact(_per_thousand(m[key])) for _, key, _ in COST_COLUMNS)]
            for name, n, m in zip(table.names, table.counts, table.metrics)]
    lines = [f"% for_evaluation/metrics_table.py: {_latex_escape(_legend(table))}",
             *_latex_tabular(header, rows, "lr" + "c" * len(table.columns) + "r" * len(COST_COLUMNS))]
    if table.pairs:
        pair_header = ["A vs B", "pairs", "$\\Delta$CR", "only A", "only B", "McNemar exact $p$"]
        pair_rows = [[f"{_latex_escape(a)} vs {_latex_escape(b)}", str(c.n_pairs),
                      _latex_cell(c.cr_difference, digits, table.n_resamples), str(c.only_a_completed),
                      str(c.only_b_completed), f"{c.mcnemar_p:.4g}"] for a, b, c in table.pairs]
        lines += ["", *_latex_tabular(pair_header, pair_rows, "lrcrrr")]
    return "\n".join(lines) + "\n"


def _csv(table: ComparisonTable) -> str:
    """value, low, high and resamples per metric column, then the cost columns per 1,000 dialogues; empty cells
    for undefined values."""
    def number(value: float | int | None) -> str:
        return "" if value is None else repr(value)

    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["agent", "n_dialogues",
                     *(f"{c}_{part}" for c, _, _ in table.columns for part in ("value", "low", "high", "resamples")),
                     *(key.replace("_per_dialogue", f"_per_{PER // 1000}k_dialogues") for _, key, _ in COST_COLUMNS)])
    for name, n, m in zip(table.names, table.counts, table.metrics):
        writer.writerow([name, n, *(number(value) for _, key, _ in table.columns
                                    for value in (m[key].value, m[key].low, m[key].high, m[key].resamples)),
                         *(number(_per_thousand(m[key])) for _, key, _ in COST_COLUMNS)])
    return buffer.getvalue()


def render(table: ComparisonTable, fmt: str, digits: int = 3) -> str:
    """The table as `terminal` text, `markdown`, `csv` (value, low, high, resamples per metric) or a `latex`
    tabular (a second one for the paired comparisons)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if fmt == "csv":
        return _csv(table)
    if fmt == "latex":
        return _latex(table, digits)
    header, rows = _grid(table, digits)
    pair_header, pair_rows = _pair_grid(table, digits)
    block = _aligned if fmt == "terminal" else _markdown
    parts = [block(header, rows)]
    if pair_rows:
        parts.append(block(pair_header, pair_rows))
    return "\n\n".join([*parts, _legend(table)]) + "\n"
