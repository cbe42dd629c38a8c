"""Shared drawing helpers for the run plots: figure creation without pyplot (titles wrapped to the figure's width),
curves with their raw points and, when there are enough of them, a labelled EMA, "no data" panels and saving as
PNG/SVG.

Figures are `matplotlib.figure.Figure` objects built directly (no pyplot, no global backend state), so plotting
is headless on any machine and safe in threads; `savefig` renders with the Agg (PNG) and SVG canvases.
"""
from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from llm_agent.evaluation.defaults import MIN_SMOOTH_POINTS
from llm_agent.evaluation.series import ema

__all__ = ["LINE_STYLES", "RUN_COLORS", "TITLE_SIZE", "draw_curve", "grid_figure", "legend_if_useful", "no_data", "run_color",
           "save_figure", "style_axes", "wrap_title"]

RUN_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
LINE_STYLES = ("-", "--", ":", "-.")
TITLE_SIZE = 13  # points, bold
_CHAR_WIDTH = 0.62  # a bold character's width as a share of its font size (about; wrapping keeps a margin)


def run_color(index: int) -> str:
    """The colour of the index-th run (runs keep their colour across every figure)."""
    return RUN_COLORS[index % len(RUN_COLORS)]


def grid_figure(n_panels: int, ncols: int = 3, panel_size: tuple[float, float] = (4.6, 3.0),
                title: str | None = None) -> tuple[Figure, list[Axes]]:
    """A figure with `n_panels` axes on a grid of `ncols` columns (unused cells removed)."""
    ncols = max(1, min(ncols, n_panels))
    nrows = max(1, math.ceil(n_panels / ncols))
    fig = Figure(figsize=(panel_size[0] * ncols, panel_size[1] * nrows + (0.5 if title else 0.0)),
                 layout="constrained")
    axes = list(np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False)).ravel())
    for ax in axes[n_panels:]:
        ax.remove()
    if title:
        fig.suptitle(wrap_title(title, fig.get_figwidth()), fontsize=TITLE_SIZE, fontweight="bold")
    return fig, axes[:n_panels]


def wrap_title(title: str, width_in: float) -> str:
    """`title` broken into lines that fit a figure `width_in` inches wide at the title's font size."""
    chars = max(12, int(0.95 * width_in * 72 / (TITLE_SIZE * _CHAR_WIDTH)))
    return textwrap.fill(title, width=chars)


def draw_curve(ax: Axes, steps: np.ndarray, values: np.ndarray, color: str, label: str, smooth: float,
               linestyle: str = "-", markers: bool = False) -> None:
    """Plot one series. Its raw values are always drawn; with smoothing > 0 and at least `MIN_SMOOTH_POINTS`
    defined points a debiased EMA goes on top (labelled "EMA <weight>"), since over a handful of points an EMA
    mostly lags and would end far from the last value. NaN values (undefined at that step) leave a gap, and the
    label says at how many steps. `markers` marks every point (sparse series such as validations)."""
    if len(steps) == 0:
        return
    defined = np.isfinite(values)
    undefined = int((~defined).sum())
    if undefined and label:
        label = f"{label} (n/a at {undefined} step{'s' if undefined > 1 else ''})"
    marker = "o" if markers or len(steps) <= 12 else None
    if smooth > 0 and defined.sum() >= MIN_SMOOTH_POINTS:
        ax.plot(steps, values, color=color, alpha=0.45, linewidth=1.0, marker=marker, markersize=3,
                linestyle=linestyle, gid="raw")
        ax.plot(steps, ema(values, smooth), color=color, linewidth=2.0, linestyle=linestyle,
                label=f"{label} (EMA {smooth:g})" if label else f"EMA {smooth:g}", gid="smoothed")
    else:
        ax.plot(steps, values, color=color, linewidth=1.8, linestyle=linestyle, marker=marker, markersize=4,
                label=label, gid="raw")


def no_data(ax: Axes, message: str) -> None:
    """Mark an axes as empty with a centred grey message."""
    ax.text(0.5, 0.5, message, ha="center", va="center", color="grey", fontsize=9, wrap=True,
            transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def style_axes(ax: Axes, title: str, ylabel: str = "", xlabel: str = "step") -> None:
    """Title, axis labels and a light grid; integer step ticks."""
    ax.set_title(title, fontsize=10.5)
    ax.set_xlabel(xlabel, fontsize=9)
    if ylabel:
        ax.set_ylabel(ylabel, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.tick_params(labelsize=8)
    if xlabel == "step":
        ax.xaxis.get_major_locator().set_params(integer=True)


def legend_if_useful(ax: Axes, min_labels: int = 2) -> None:
    """A small legend when at least `min_labels` labelled lines share the axes, or when a label says something
    the line cannot (smoothing, undefined points)."""
    labels = ax.get_legend_handles_labels()[1]
    if len(labels) >= min_labels or any("EMA" in text or "n/a" in text for text in labels):
        ax.legend(fontsize=7.5, loc="best", framealpha=0.8)


def save_figure(fig: Figure, out_dir: Path, name: str, formats: Sequence[str]) -> list[Path]:
    """Write `fig` as `<out_dir>/<name>.<fmt>` for each format; the PNG carries no software/URL metadata."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        path = out_dir / f"{name}.{fmt}"
        metadata = {"Software": None} if fmt == "png" else {"Creator": None, "Date": None} if fmt == "svg" else None
        fig.savefig(path, format=fmt, dpi=110, metadata=metadata)
        paths.append(path)
    return paths
