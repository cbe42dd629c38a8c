"""The run report: one self-contained HTML file with the plots, the metrics table, the mistakes analysis and a
dialogue browser over every dialogue of the run (or of an evaluation).

The page loads nothing from anywhere: the plots are PNG data URIs, the CSS and JavaScript (`report_assets/`)
are inlined, and the dialogues are one embedded JSON document that the browser's script renders a page at a
time. Groups of dialogues: training dialogues over all steps and at the last step; every other split
(validation, an evaluation) at its last step, since each of its steps meets the same users again.
"""
from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from string import Template
from typing import Any

from llm_agent.evaluation.analysis import analyze_dialogues, before_after_groups
from llm_agent.evaluation.browser_data import browser_payload, embed_json
from llm_agent.evaluation.defaults import DEFAULT_BROWSER_LIMIT, DEFAULT_CONFIDENCE, DEFAULT_RESAMPLES
from llm_agent.evaluation.headline import GapOf, IntervalOf, cr_points, gap_points, headline_html
from llm_agent.evaluation.page_text import esc
from llm_agent.evaluation.plots import RunData, build_figures, load_run
from llm_agent.evaluation.report_sections import analysis_html, cr_by_state_caption, metrics_html, plots_html
from llm_agent.evaluation.report_simulator import simulator_html
from llm_agent.evaluation.run_data import RunFiles, output_root
from llm_agent.evaluation.stats import metric_intervals, paired_comparison
from llm_agent.metrics import dialogue_metrics, index_keys, metric_keys
from llm_agent.rollout.dialogue_record import DialogueRecord
from llm_agent.scenario import Scenario

logger = logging.getLogger(__name__)

__all__ = ["DialogueGroup", "build_report", "default_report_path", "dialogue_groups", "render_report"]

ASSETS = "report_assets"  # package data of llm_agent.evaluation: the page template, its CSS and JavaScript


@dataclass
class DialogueGroup:
    """A named set of dialogues of one split: its label, what it covers, and the records."""

    split: str
    label: str
    scope: str
    records: list[DialogueRecord]
    pooled: bool = False  # several steps of a changing policy pooled: no confidence interval


def dialogue_groups(records: Sequence[DialogueRecord]) -> tuple[list[DialogueGroup], list[DialogueGroup]]:
    """(metric-table groups, analysis groups) of `records` by split (see the module docstring); `train` first."""
    by_split: dict[str, list[DialogueRecord]] = {}
    for record in records:
        by_split.setdefault(str(record.split or "all"), []).append(record)
    table, analysis = [], []
    for split in sorted(by_split, key=lambda s: (s != "train", s)):
        rows = by_split[split]
        steps = sorted({r.step for r in rows if isinstance(r.step, int)})
        last = [r for r in rows if r.step == steps[-1]] if steps else rows
        last_group = DialogueGroup(split, f"{split} (step {steps[-1]})" if steps else split,
                                   f"step {steps[-1]}" if steps else "all dialogues", last)
        if split == "train" and len(steps) > 1:
            everything = DialogueGroup(split, f"{split} (steps {steps[0]}-{steps[-1]})",
                                       f"all {len(steps)} steps", rows, pooled=True)
            table += [everything, last_group]
            analysis.append(everything)
        else:
            table.append(last_group)
            analysis.append(last_group)
    return table, analysis


def _metric_columns(groups: Sequence[DialogueGroup], scenario: Scenario, bootstrap: int) -> list[tuple[str, Any]]:
    columns = []
    for group in groups:
        if bootstrap > 0 and not group.pooled:
            intervals = metric_intervals(group.records, scenario, n_resamples=bootstrap)
            columns.append((group.label, {k: iv.to_dict() for k, iv in intervals.items()}))
        else:
            columns.append((group.label, dialogue_metrics(group.records, scenario)))
    return columns


def _cr_interval(scenario: Scenario, bootstrap: int) -> IntervalOf | None:
    """The headline's CR interval of a group: exactly the metrics table's (the same records, resamples and seed)."""
    if bootstrap <= 0:
        return None

    def interval(records: Sequence[DialogueRecord]) -> tuple[float, float] | None:
        cr = metric_intervals(records, scenario, n_resamples=bootstrap)["completion_rate"]
        return None if cr.low is None or cr.high is None else (cr.low, cr.high)
    return interval


def _paired_gap(scenario: Scenario, bootstrap: int) -> GapOf:
    """The headline's exploitation gap of two groups: the paired CR difference and, with `bootstrap`, its paired
    bootstrap interval (`paired_comparison`)."""
    def gap(main: Sequence[DialogueRecord], judged: Sequence[DialogueRecord]) -> tuple[float, Any] | None:
        comparison = paired_comparison(main, judged, scenario, n_resamples=max(bootstrap, 1))
        if comparison is None or comparison.cr_difference.value is None:
            return None
        d = comparison.cr_difference
        interval = (d.low, d.high) if bootstrap > 0 and d.low is not None and d.high is not None else None
        return d.value, interval
    return gap


def _asset(name: str) -> str:
    return resources.files("llm_agent.evaluation").joinpath(ASSETS, name).read_text(encoding="utf-8")


def render_report(run: RunData, scenario: Scenario, sources: str, smooth: float = 0.6,
                  bootstrap: int = DEFAULT_RESAMPLES, controller: Mapping[str, Any] | None = None,
                  browser_limit: int = DEFAULT_BROWSER_LIMIT, simulator_cards: Sequence[Mapping[str, Any]] = ()) -> str:
    """The report page of `run` as HTML text. `bootstrap` resamples per metric interval (0: no intervals);
    `controller` overrides ControllerConfig keys for the recommended weights; the dialogue browser holds the
    last `browser_limit` dialogues (metrics and analysis always use all); `simulator_cards` are simulator report
    cards (llm_agent.simulator_report) shown in the user-simulator section."""
    if browser_limit < 1:
        raise ValueError(f"browser_limit must be >= 1, got {browser_limit}")
    has_plot_data = bool(run.steps or run.val or run.dialogues)
    figures, notes = build_figures([run], smooth) if has_plot_data else ({}, [])
    records = run.dialogues or []
    table_groups, analysis_groups = dialogue_groups(records)
    columns = _metric_columns(table_groups, scenario, bootstrap)
    ci_note = (f"Brackets: percentile bootstrap {DEFAULT_CONFIDENCE:.0%} intervals over dialogues ({bootstrap} "
               f"resamples{', as metrics_table.py takes' if bootstrap == DEFAULT_RESAMPLES else ''}; "
               "llm_agent.evaluation.stats); none for training pooled over steps, whose policy changed from step "
               "to step." if bootstrap > 0 else "No intervals (bootstrap off).")
    analyses = [(g.label, g.scope, analyze_dialogues(g.records, scenario, controller=controller))
                for g in analysis_groups]
    title = f"SEAD report: {run.name}"
    generated = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    return Template(_asset("report.html")).substitute(
        title=esc(title),
        sources=esc(f"{sources} · scenario {scenario.name} · {len(records)} dialogues · generated {generated}"),
        css=_asset("report.css"),
        headline=headline_html(cr_points(records, run.val, _cr_interval(scenario, bootstrap)),
                               f"the metrics table's {DEFAULT_CONFIDENCE:.0%} bootstrap interval",
                               gap_points(records, run.val, _paired_gap(scenario, bootstrap))),
        plots=plots_html(figures, notes, {"cr_by_initial_state": cr_by_state_caption(
            [label for label, _ in before_after_groups(records)] if records else [])}),
        metrics=metrics_html(columns, "Every metric as defined in llm_agent/metrics.py ("
                             + ", ".join(f"{k}: the {d} improvement" for k, d in index_keys(scenario).items())
                             + "; n/a: undefined, e.g. ATT without a completed call). " + ci_note,
                             metric_keys(scenario)),
        mistakes=analysis_html(analyses),
        simulator=simulator_html(simulator_cards),
        browser_note=esc(f"The browser holds the last {browser_limit} of the {len(records)} dialogues."
                         if len(records) > browser_limit else ""),
        data=embed_json(browser_payload(records[-browser_limit:], scenario)),
        js=_asset("report.js"))


def default_report_path(files: RunFiles) -> Path:
    """`<root>/reports/<name>.html` for a training run, `<dir>/<name>_report.html` beside an evaluation's
    dialogues file."""
    if files.metrics is None and files.dialogues is not None and files.dialogues.name.endswith("_dialogues.jsonl"):
        return files.dialogues.parent / f"{files.name}_report.html"
    return output_root(files) / "reports" / f"{files.name}.html"


def build_report(files: RunFiles, scenario: Scenario, out: str | Path | None = None, **kwargs: Any) -> Path:
    """Read the run, render its report and write it to `out` (default `default_report_path`); returns the path."""
    path = Path(out) if out is not None else default_report_path(files)
    page = render_report(load_run(files, dialogues="full"), scenario, files.describe(), **kwargs)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(path)
    logger.info("report: %s (%.1f MB)", path, path.stat().st_size / 1e6)
    return path
