"""The non-line figures of `plots`: stacked shares per run, the controller's heatmaps, CR by initial state
and the cache's per-stage hit rate. Each takes the runs (`plots.RunData`) and returns a Figure, or None with a
note appended to `notes` when no run has the data."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from llm_agent.evaluation.analysis import before_after_groups, cr_by_dimension
from llm_agent.evaluation.plot_style import (draw_curve, grid_figure, legend_if_useful, no_data, run_color,
                                             style_axes)
from llm_agent.evaluation.series import cache_stage_series, cache_targets, controller_matrix

__all__ = ["cache_figure", "controller_figure", "cr_by_state_figure", "stacked_per_run_figure"]

_ANNOTATE_MAX_CELLS = 160  # write the value into each heatmap cell up to this many cells
NO_DATA_COLOR = "#eeeeee"


def stacked_per_run_figure(series: Mapping[str, tuple[np.ndarray, Mapping[str, np.ndarray]]],
                           colors: Mapping[str, str], title: str, ylabel: str, fraction: bool) -> Figure:
    """One panel per run: the parts stacked over steps (an area; bars when a run has a single step).
    `fraction` fixes the y axis to [0, 1]."""
    fig, axes = grid_figure(len(series), ncols=min(3, len(series)), panel_size=(5.2, 3.2), title=title)
    for ax, (name, (steps, parts)) in zip(axes, series.items()):
        labels = [k for k in colors if k in parts]
        values = [parts[k] for k in labels]
        if len(steps) > 1:
            ax.stackplot(steps, *values, labels=labels, colors=[colors[k] for k in labels], alpha=0.85)
        else:
            bottom = np.zeros(len(steps))
            for label, v in zip(labels, values):
                ax.bar(steps, v, bottom=bottom, color=colors[label], label=label, width=0.6)
                bottom = bottom + v
        if fraction:
            ax.set_ylim(0, 1)
        style_axes(ax, name if len(series) > 1 else "", ylabel)
        ax.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.0, 1.0), framealpha=0.8)
    return fig


def _heatmap(ax: Axes, labels: Sequence[str], steps: np.ndarray, matrix: np.ndarray, title: str, cmap: str,
             vmin: float, vmax: float, ylabel: str, missing: str) -> None:
    """A (value x step) heatmap; NaN cells are grey and a legend below says what they mean (`missing`)."""
    masked = np.ma.masked_invalid(matrix)
    colormap = colormaps[cmap].with_extremes(bad=NO_DATA_COLOR)
    image = ax.imshow(masked, aspect="auto", origin="lower", cmap=colormap, vmin=vmin, vmax=vmax,
                      interpolation="nearest")
    ax.set_yticks(range(len(labels)), labels)
    stride = max(1, len(steps) // 12)
    ticks = list(range(0, len(steps), stride))
    ax.set_xticks(ticks, [str(int(steps[t])) for t in ticks])
    if matrix.size <= _ANNOTATE_MAX_CELLS:
        for (i, j), value in np.ndenumerate(matrix):
            if np.isfinite(value):
                r, g, b, _ = image.cmap(image.norm(value))
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7,
                        color="black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white")
    ax.set_title(title, fontsize=10.5)
    ax.set_xlabel("step", fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9)
    ax.tick_params(labelsize=8)
    ax.figure.colorbar(image, ax=ax, shrink=0.85)
    if np.isnan(matrix).any():
        ax.legend(handles=[Patch(facecolor=NO_DATA_COLOR, edgecolor="#999999", label=missing)], fontsize=7.5,
                  loc="upper center", bbox_to_anchor=(0.5, -0.28), frameon=False)


def controller_figure(runs: Sequence[Any], dim: str, notes: list[str]) -> Figure | None:
    """Per run with controller metrics: the sampling weight of each initial value of `dim` over steps, and the
    CR per value the controller saw at that step's update (grey: no dialogue of that value)."""
    rows = []
    for run in runs:
        weights = controller_matrix(run.steps, "controller/weight/", dim)
        if weights[0]:
            rows.append((run.name, weights, controller_matrix(run.steps, "controller/cr/", dim)))
    if not rows:
        notes.append(f"controller_{dim} skipped (no controller/weight/{dim}=<value> metrics: controller off?)")
        return None
    fig, axes = grid_figure(2 * len(rows), ncols=2, panel_size=(5.6, 2.2 + 0.25 * len(rows[0][1][0])),
                            title=f"State controller: initial {dim}")
    for k, (name, (labels, steps, matrix), (cr_labels, cr_steps, cr_matrix)) in enumerate(rows):
        prefix = f"{name}: " if len(rows) > 1 else ""
        top = float(np.nanmax(matrix)) if np.isfinite(matrix).any() else 1.0
        _heatmap(axes[2 * k], labels, steps, matrix, f"{prefix}sampling weight", "viridis", 0.0, max(top, 1e-9),
                 f"{dim} value", "no data: weight not logged at that step")
        if cr_labels:
            _heatmap(axes[2 * k + 1], cr_labels, cr_steps, cr_matrix, f"{prefix}CR per value at the update",
                     "RdYlGn", 0.0, 1.0, f"{dim} value", "no data: no dialogue with that value at that update")
        else:
            no_data(axes[2 * k + 1], f"no controller/cr/{dim}=<value> metrics")
    return fig


def cr_by_state_figure(runs: Sequence[Any], dims: Sequence[str], notes: list[str]) -> Figure | None:
    """CR per initial value of each state dimension of `dims` with Wilson 95% intervals: per run, the first and the last
    validation side by side (before vs after training), labelled with their steps (`before_after_groups`)."""
    groups: list[tuple[str, dict[str, list[dict[str, float]]]]] = []
    for run in runs:
        if not run.dialogues:
            continue
        for label, records in before_after_groups(run.dialogues):
            groups.append((f"{run.name}: {label}" if len(runs) > 1 else label, cr_by_dimension(records, dims)))
    if not groups or not dims:
        notes.append("cr_by_initial_state skipped (no dialogues: rollouts.jsonl not found)")
        return None
    fig, axes = grid_figure(len(dims), ncols=3, panel_size=(4.8, 3.4),
                            title="Completion rate by initial user state (bars: CR; whiskers: 95% Wilson intervals)")
    width = 0.8 / len(groups)
    for ax, dim in zip(axes, dims):
        values = sorted({row["value"] for _, by_dim in groups for row in by_dim[dim]})
        position = {v: i for i, v in enumerate(values)}
        for g, (label, by_dim) in enumerate(groups):
            rows = by_dim[dim]
            x = np.asarray([position[r["value"]] for r in rows], dtype=float) - 0.4 + width * (g + 0.5)
            cr = np.asarray([r["cr"] for r in rows])
            err = np.clip([[r["cr"] - r["ci_low"] for r in rows], [r["ci_high"] - r["cr"] for r in rows]], 0, None)
            ax.bar(x, cr, width=width * 0.95, color=run_color(g), label=label, alpha=0.85)
            ax.errorbar(x, cr, yerr=err, fmt="none", ecolor="black", elinewidth=0.8, capsize=2)
            for xi, r in zip(x, rows):
                ax.text(xi, min(r["ci_high"] + 0.02, 1.02), f"n={r['n']}", ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(values)), [str(v) for v in values])
        ax.set_ylim(0, 1.15)
        style_axes(ax, dim, "completion rate", xlabel=f"initial {dim}")
        ax.legend(fontsize=7, loc="upper left", framealpha=0.8)  # always: it says which step each bar is
    return fig


def cache_figure(runs: Sequence[Any], smooth: float, notes: list[str]) -> Figure | None:
    """Per run, the cache hit rate (hits / eligible lookups) of each SOP stage over steps, and the configured
    target rate of each stage as a dashed line of the same colour."""
    panels = [(run.name, cache_stage_series(run.steps), cache_targets(run.steps)) for run in runs]
    panels = [(name, s, t) for name, s, t in panels if s]
    if not panels:
        notes.append("cache_hit_rate_by_stage skipped (no cache/hit_rate/stage<id> metrics: cache off?)")
        return None
    fig, axes = grid_figure(len(panels), ncols=min(3, len(panels)), panel_size=(5.4, 3.4),
                            title="User-response cache: hit rate by SOP stage (dashed: configured target)")
    for ax, (name, stages, targets) in zip(axes, panels):
        for k, (stage, (steps, rates)) in enumerate(stages.items()):
            draw_curve(ax, steps, rates, run_color(k), stage, smooth)
            if stage in targets:
                ax.axhline(targets[stage], color=run_color(k), linestyle="--", linewidth=1.0, alpha=0.8,
                           label=f"{stage} target {targets[stage]:.2f}", gid="target")
        if not targets:
            notes.append(f"cache_hit_rate_by_stage: {name} logged no cache/target_hit_rate/stage<id> (a run from "
                         "before targets were logged): no target lines")
        ax.set_ylim(-0.02, 1.02)
        style_axes(ax, name if len(panels) > 1 else "hit rate per stage", "hits / eligible lookups")
        legend_if_useful(ax, min_labels=1)  # name the stage even when only one has data
    return fig
