"""Plots of training runs: what `python for_evaluation/metrics_vis.py` draws.

`plot_runs(runs, out_dir)` writes, for one run or several compared on the same axes (one colour per run):

    training_curves          reward, completion rate, turns (ATT/ADT), format errors, KL, entropy, lr, throughput
    training_outcome_mix     share of dialogues per outcome over steps (stacked area, one panel per run)
    training_time_split      seconds per step generating vs waiting for the user simulator (stacked, per run)
    validation_curves        the validation dialogue metrics at each validation step
    controller_<dimension>   per state dimension of the runs' scenario (their dialogues' profiles, else their
                             controller metrics): the controller's sampling weights and per-value CR over steps
                             (heatmaps, per run; cells without data in grey, with a legend)
    cr_by_initial_state      CR per initial value of each state dimension with Wilson 95% intervals, before and
                             after training side by side (first and last validation; else an evaluation's or the
                             last training step's dialogues)
    cache_hit_rate_by_stage  the user-response cache's hit rate per SOP stage over steps, beside its configured
                             target rate

as PNG and SVG. A figure or panel whose metrics no run has is skipped and a note says which keys were missing.
Raw values are always drawn; with smoothing > 0 a series of at least `MIN_SMOOTH_POINTS` points also gets a
debiased EMA, labelled. A metric undefined at some steps (left out of the metrics: ATT when no call completed)
leaves a gap there and its label says so. Series of one panel that are exactly equal (the score and the reward
without a KL penalty) are one line named after both.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from llm_agent.evaluation.plot_panels import (cache_figure, controller_figure, cr_by_state_figure,
                                              stacked_per_run_figure)
from llm_agent.evaluation.plot_style import (LINE_STYLES, draw_curve, grid_figure, legend_if_useful, run_color,
                                             save_figure, style_axes)
from llm_agent.evaluation.browser_data import profile_dims
from llm_agent.evaluation.run_data import (RunFiles, read_dialogue_summaries, read_dialogues, read_step_metrics,
                                           read_val_metrics)
from llm_agent.evaluation.series import OUTCOME_RATE_KEYS, metric_series, outcome_mix, present_keys
from llm_agent.reward import COMPONENTS
from llm_agent.rollout.dialogue_record import DialogueRecord
from llm_agent.rollout.judges import RESERVED

logger = logging.getLogger(__name__)

__all__ = ["PlotResult", "RunData", "TRAINING_PANELS", "VALIDATION_PANELS", "build_figures", "figure_names",
           "load_run", "plot_runs"]

# (panel title, y label, metric keys drawn in it); a panel is drawn when any run has any of its keys
INDEX_PANEL = "state change (improvement indices)"  # the `<short>i` metrics that come with a `<short>i_agent`
# (EI / TI / CI for the shipped scenarios), whatever the runs' scenario
TRAINING_PANELS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("reward (sequence score)", "mean per dialogue", ("critic/score/mean", "critic/rewards/mean")),
    ("reward components (weighted)", "mean per dialogue", tuple(f"reward/{c}" for c in COMPONENTS)),
    ("completion rate (CR)", "share of dialogues", ("dialogue/completion_rate",)),
    ("turns per dialogue", "turns", ("dialogue/att", "dialogue/adt")),
    ("format errors", "errors per turn", ("dialogue/format_error_rate",)),
    ("KL", "", ("actor/kl_loss", "actor/ppo_kl", "actor/reward_kl_penalty")),
    ("entropy", "nats per token", ("actor/entropy",)),
    ("learning rate", "lr", ("actor/lr",)),
    ("throughput", "tokens / s", ("perf/tokens_per_s",)),
)
VALIDATION_PANELS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("completion rate (CR)", "share", ("val/dialogue/completion_rate",)),
    ("false-positive rate", "share of done claims", ("val/dialogue/false_positive_rate",)),
    ("turns per dialogue", "turns", ("val/dialogue/att", "val/dialogue/adt")),
    ("user-state accuracy (UPA)", "1 - normalised error", ("val/dialogue/upa",)),
    (INDEX_PANEL, "last - first, better is up", ()),  # its keys: the runs' improvement metrics
    ("format errors / stage completeness", "share",
     ("val/dialogue/format_error_rate", "val/dialogue/stage_completeness")),
    ("reward (sequence score)", "mean per dialogue", ("val/reward/total",)),
)
VAL_CR, JUDGE_CR, GAP = "val/dialogue/completion_rate", "completion_rate", "exploitation_gap"
GAP_PANEL = "exploitation gap (docs/simulator.md)"
TIME_KEYS = {"generation": "rollout/time_generate_s", "user simulator": "rollout/time_user_sim_s"}


def figure_names(dims: Sequence[str]) -> tuple[str, ...]:
    """Every figure `build_figures` can draw for runs of a scenario with state dimensions `dims`, in order."""
    return ("training_curves", "training_outcome_mix", "training_time_split", "validation_curves",
            *(f"controller_{d}" for d in dims), "cr_by_initial_state", "cache_hit_rate_by_stage")


OUTCOME_COLORS = {"completed": "#2ca02c", "hung_up": "#d62728", "agent_ended": "#ff7f0e", "timeout": "#9467bd",
                  "truncated": "#8c564b", "error": "#7f7f7f"}


@dataclass
class RunData:
    """One run's data for plotting: tracked training rows, validation rows (with `val/` keys) and dialogues."""

    name: str
    steps: list[dict[str, float]] = field(default_factory=list)
    val: list[dict[str, float]] = field(default_factory=list)
    dialogues: list[DialogueRecord] | None = None

    @property
    def dims(self) -> list[str]:
        """The state dimensions of the run's scenario: its dialogues' profiles', else those its controller metrics
        (`controller/weight/<dimension>=<value>`) name, in order of appearance."""
        found = profile_dims(self.dialogues or [])
        if found:
            return found
        names: dict[str, None] = {}
        for row in self.steps:
            for key in row:
                if key.startswith("controller/weight/") and "=" in key:
                    names.setdefault(key[len("controller/weight/"):].split("=", 1)[0])
        return list(names)


@dataclass
class PlotResult:
    """Written files (in figure order) and the notes on what was skipped and why."""

    files: list[Path]
    notes: list[str]


def load_run(files: RunFiles, dialogues: str = "summary") -> RunData:
    """Read a run's files. Validation rows come from the tracked `val/` keys; when metrics.jsonl has none,
    from val_metrics.jsonl. `dialogues`: "summary" (outcome, split, step, initial state: what the plots need,
    read line by line), "full" (every field, for the report) or "none"."""
    if dialogues not in ("summary", "full", "none"):
        raise ValueError(f"dialogues must be 'summary', 'full' or 'none', got {dialogues!r}")
    steps = read_step_metrics(files.metrics) if files.metrics is not None and files.metrics.is_file() else []
    val = [{k: v for k, v in row.items() if k == "step" or k.startswith("val/")}
           for row in steps if any(k.startswith("val/") for k in row)]
    if not val and files.val_metrics is not None:
        val = read_val_metrics(files.val_metrics)
    train = [{k: v for k, v in row.items() if not k.startswith("val/")} for row in steps]
    train = [row for row in train if len(row) > 1]
    records = None
    if files.dialogues is not None and dialogues != "none":
        read = read_dialogues if dialogues == "full" else read_dialogue_summaries
        records = read(files.dialogues) + [r for path in files.human for r in read(path)]
    return RunData(name=files.name, steps=train, val=val, dialogues=records)


def _short_names(keys: Sequence[str]) -> dict[str, str]:
    """Each key without the path segments all keys share at the front ("critic/score/mean" -> "score/mean")."""
    parts = [k.split("/") for k in keys]
    common = 0
    while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
        common += 1
    return {k: "/".join(p[common:]) for k, p in zip(keys, parts)}


def _merge_identical(series: list[tuple[str, np.ndarray, np.ndarray]]) -> list[tuple[list[str], np.ndarray, np.ndarray]]:
    """Group the (key, steps, values) series that are exactly equal (NaN where NaN), in first-seen order, so that
    e.g. the score and the reward of a run without a KL penalty are one line named after both, not a line hidden
    under another."""
    groups: list[tuple[list[str], np.ndarray, np.ndarray]] = []
    for key, steps, values in series:
        for keys, g_steps, g_values in groups:
            if np.array_equal(steps, g_steps) and np.array_equal(values, g_values, equal_nan=True):
                keys.append(key)
                break
        else:
            groups.append(([key], steps, values))
    return groups


def _curves_figure(runs: Sequence[RunData], panels: Sequence[tuple[str, str, tuple[str, ...]]], rows_of: str,
                   title: str, smooth: float, notes: list[str], figure: str) -> Figure | None:
    """A grid of line panels, one per entry of `panels` that some run has data for."""
    keys_present = set().union(*(present_keys(getattr(r, rows_of)) for r in runs))
    used = []
    for panel in panels:
        have = [k for k in panel[2] if k in keys_present]
        if have:
            used.append((panel[0], panel[1], have))
        else:
            notes.append(f"{figure}: panel {panel[0]!r} skipped (no {', '.join(panel[2])} in any run)")
    if not used:
        return None
    fig, axes = grid_figure(len(used), ncols=4 if len(used) > 6 else 3, title=title)
    for ax, (panel_title, ylabel, keys) in zip(axes, used):
        if len(keys) > 3:  # many-key panels (reward components): leave out keys that are 0 throughout
            keys = [k for k in keys if any(np.nan_to_num(metric_series(getattr(r, rows_of), k)[1]).any()
                                           for r in runs)] or keys
        short = _short_names(keys)
        for i, run in enumerate(runs):
            series = [(key, *metric_series(getattr(run, rows_of), key, undefined_as_nan=True)) for key in keys]
            for same, steps, values in _merge_identical([s for s in series if len(s[1])]):
                j = keys.index(same[0])
                names = " = ".join(short[k] for k in same) if len(keys) > 1 else ""
                label = " / ".join(x for x in (run.name if len(runs) > 1 else "", names) if x) or run.name
                # one run: a colour and a line style per key; several: a colour per run and a line style per key
                color = run_color(j) if len(runs) == 1 else run_color(i)
                draw_curve(ax, steps, values, color, label, 0.0 if rows_of == "val" else smooth,
                           linestyle=LINE_STYLES[j % len(LINE_STYLES)], markers=rows_of == "val")
        style_axes(ax, panel_title, ylabel)
        legend_if_useful(ax)
    return fig


def _outcome_mix_figure(runs: Sequence[RunData], notes: list[str]) -> Figure | None:
    series = {}
    for run in runs:
        steps, shares = outcome_mix(run.steps, "dialogue/")
        if len(steps):
            series[run.name] = (steps, shares)
    if not series:
        notes.append("training_outcome_mix skipped (no run has all of "
                     f"{', '.join('dialogue/' + k for k in OUTCOME_RATE_KEYS.values())})")
        return None
    return stacked_per_run_figure(series, OUTCOME_COLORS, "Outcome mix of training dialogues",
                                  "share of dialogues", fraction=True)


def _time_split_figure(runs: Sequence[RunData], notes: list[str]) -> Figure | None:
    series = {}
    for run in runs:
        parts = {label: metric_series(run.steps, key) for label, key in TIME_KEYS.items()}
        if all(len(s) for s, _ in parts.values()):
            steps = parts["generation"][0]
            series[run.name] = (steps, {label: v for label, (_, v) in parts.items()})
    if not series:
        notes.append(f"training_time_split skipped (no run has {' and '.join(TIME_KEYS.values())})")
        return None
    return stacked_per_run_figure(series, {"generation": "#1f77b4", "user simulator": "#ff7f0e"},
                                  "Rollout time per step: generation vs user simulator", "seconds", fraction=False)


def _with_judges(panels: list[tuple[str, str, tuple[str, ...]]], val_keys: set[str]
                 ) -> list[tuple[str, str, tuple[str, ...]]]:
    """The validation panels with each judge's CR curve beside the training simulator's (`val/<judge>/
    completion_rate`) and, when validation ran judges, an exploitation-gap panel."""
    judge_crs = tuple(k for k in sorted(val_keys) if k.startswith("val/") and k.endswith(f"/{JUDGE_CR}")
                      and k.count("/") == 2 and k.split("/")[1] not in RESERVED)
    gaps = tuple(k for k in sorted(val_keys) if k.startswith("val/") and k.endswith(GAP))
    out = [(title, label, (*keys, *judge_crs) if VAL_CR in keys else keys) for title, label, keys in panels]
    return [*out, (GAP_PANEL, "CR(training sim) - CR(judge)", gaps)] if gaps else out


def build_figures(runs: Sequence[RunData], smooth: float = 0.6) -> tuple[dict[str, Figure], list[str]]:
    """Every figure of the module docstring that has data, by file stem, and notes on what was skipped."""
    if not runs:
        raise ValueError("build_figures needs at least one run")
    notes: list[str] = []
    dims = list(dict.fromkeys(d for run in runs for d in run.dims))
    val_keys = set().union(*(present_keys(r.val) for r in runs))
    indices = tuple(k for k in sorted(val_keys) if f"{k}_agent" in val_keys and k.startswith("val/dialogue/"))
    validation = [(title, label, indices if title == INDEX_PANEL else keys) for title, label, keys in VALIDATION_PANELS]
    validation = _with_judges(validation, val_keys)
    figures: dict[str, Figure | None] = {
        "training_curves": _curves_figure(runs, TRAINING_PANELS, "steps", "Training", smooth, notes,
                                          "training_curves"),
        "training_outcome_mix": _outcome_mix_figure(runs, notes),
        "training_time_split": _time_split_figure(runs, notes),
        "validation_curves": _curves_figure(runs, validation, "val", "Validation", smooth, notes,
                                            "validation_curves"),
    }
    for dim in dims:
        figures[f"controller_{dim}"] = controller_figure(runs, dim, notes)
    figures["cr_by_initial_state"] = cr_by_state_figure(runs, dims, notes)
    figures["cache_hit_rate_by_stage"] = cache_figure(runs, smooth, notes)
    if not any(run.steps for run in runs):
        notes.insert(0, "no training metrics found (metrics.jsonl missing or empty): training figures skipped")
    return {name: fig for name, fig in figures.items() if fig is not None}, notes


def plot_runs(runs: Sequence[RunData], out_dir: str | Path, smooth: float = 0.6,
              formats: Sequence[str] = ("png", "svg")) -> PlotResult:
    """Build and write every figure of `runs` under `out_dir`; returns the files and the skip notes."""
    figures, notes = build_figures(runs, smooth)
    files: list[Path] = []
    for name, fig in figures.items():
        files.extend(save_figure(fig, Path(out_dir), name, formats))
    for note in notes:
        logger.info("plots: %s", note)
    return PlotResult(files=files, notes=notes)
