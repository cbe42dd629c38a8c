"""HTML fragments of the run report: the plot gallery, the metrics table and the mistakes analysis.

Every value from the data is escaped; the fragments hold no script and reference nothing outside the page.
"""
from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.figure import Figure

from llm_agent.evaluation.defaults import MIN_SMOOTH_POINTS
from llm_agent.evaluation.page_text import esc as _esc
from llm_agent.metrics import NOT_AVAILABLE

__all__ = ["analysis_html", "cr_by_state_caption", "metrics_html", "plots_html"]

PLOT_CAPTIONS = {
    "training_curves": f"Training curves per step: raw values, and a labelled EMA over series of {MIN_SMOOTH_POINTS} "
                       "points or more; a gap where a metric is undefined.",
    "training_outcome_mix": "How training dialogues ended, as shares of all dialogues per step.",
    "training_time_split": "Rollout seconds per step spent generating vs waiting for the user simulator.",
    "validation_curves": "Validation metrics on the fixed validation users at each validation step.",
    "cr_by_initial_state": "Completion rate by the simulated user's initial state, before and after training (first "
                           "and last validation), with 95% Wilson intervals.",
    "cache_hit_rate_by_stage": "User-response cache hit rate (hits / eligible lookups) per SOP stage; dashed: the "
                               "configured target.",
}


def _num(value: Any, digits: int = 3) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1:
        return str(int(value))
    return f"{value:.{digits}f}" if isinstance(value, float) else _esc(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], numeric_from: int = 1, cls: str = "") -> str:
    """An HTML table; cells are already-escaped HTML; columns from `numeric_from` on are right-aligned."""
    head = "".join(f'<th{" class=num" if i >= numeric_from else ""}>{_esc(h)}</th>' for i, h in enumerate(header))
    body = "".join("<tr>" + "".join(f'<td{" class=num" if i >= numeric_from else ""}>{c}</td>'
                                    for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _png_data_uri(fig: Figure) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, metadata={"Software": None})
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def cr_by_state_caption(group_labels: Sequence[str]) -> str:
    """The caption of `cr_by_initial_state` for its groups of dialogues (`analysis.before_after_groups`): before
    and after training only when there are two to compare."""
    if len(group_labels) != 1:
        return PLOT_CAPTIONS["cr_by_initial_state"]
    return (f"Completion rate by the simulated user's initial state, {group_labels[0]} (one set of dialogues: "
            "nothing before or after to compare), with 95% Wilson intervals.")


def plots_html(figures: Mapping[str, Figure], notes: Sequence[str], captions: Mapping[str, str] | None = None) -> str:
    """Each figure as an embedded PNG (data URI) with a caption (`captions` overrides the defaults), then the
    notes on skipped figures."""
    parts = []
    for name, fig in figures.items():
        caption = (captions or {}).get(name) or PLOT_CAPTIONS.get(name) or (f"The state controller's sampling weights (left) and the CR it saw "
                                              f"per value (right), {name.split('_', 1)[-1]} dimension.")
        parts.append(f'<figure id="plot-{_esc(name)}"><img alt="{_esc(name)}" src="{_png_data_uri(fig)}">'
                     f"<figcaption><b>{_esc(name)}</b>: {_esc(caption)}</figcaption></figure>")
    if not figures:
        parts.append('<p class="note">No plots: the run has no training metrics or dialogues.</p>')
    if notes:
        parts.append('<ul class="note">' + "".join(f"<li>{_esc(n)}</li>" for n in notes) + "</ul>")
    return "\n".join(parts)


def metrics_html(columns: Sequence[tuple[str, Mapping[str, Any]]], note: str, keys: Sequence[str]) -> str:
    """One row per dialogue metric of `keys` (`llm_agent.metrics.metric_keys` of the scenario), one column per
    group of dialogues. A column's value per metric is a float or a {"value", "low", "high"} interval (printed with
    its bracket); an undefined one (absent or None) is n/a."""
    if not columns:
        return '<p class="note">No dialogues to compute metrics over.</p>'
    rows = []
    for key in keys:
        cells = [f"<code>{_esc(key)}</code>"]
        for _, values in columns:
            v = values.get(key)
            if isinstance(v, Mapping) and v.get("value") is not None:
                cells.append(f'{_num(v["value"])} <span class="ci">[{_num(v["low"])}, {_num(v["high"])}]</span>')
            elif v is None or isinstance(v, Mapping):  # undefined (e.g. ATT with no completed call)
                cells.append(NOT_AVAILABLE)
            else:
                cells.append(_num(v))
        rows.append(cells)
    return _table(["metric", *(name for name, _ in columns)], rows) + f'<p class="note">{_esc(note)}</p>'


def _rate_cells(r: Mapping[str, Any]) -> list[str]:
    bar = f'<span class="bar" style="width:{60 * r["cr"]:.0f}px"></span>'
    return [str(r["n"]), f'{bar}{r["cr"]:.3f}', f'[{r["ci_low"]:.3f}, {r["ci_high"]:.3f}]']


def _combo_table(combos: Sequence[Mapping[str, Any]], dims: Sequence[str]) -> str:
    return _table(["state", *dims, "n", "CR", "95% interval"],
                  [[_esc(c["state_key"]), *(str(c[d]) for d in dims), *_rate_cells(c)] for c in combos])


def _split_html(name: str, scope: str, a: Mapping[str, Any]) -> str:
    c, dims = a["completion"], a["dimensions"]
    parts = [f'<h3>{_esc(name)} <span class="note">({_esc(scope)})</span></h3>',
             f'<p>{a["n_dialogues"]} dialogues, {a["n_errors"]} errors (left out of every CR); '
             f'CR {c["cr"]:.3f} [{c["ci_low"]:.3f}, {c["ci_high"]:.3f}] over {a["n_scored"]}.</p>',
             "<h4>CR by initial-state value</h4><div class=grid>"]
    for dim, rows in a["by_dimension"].items():
        parts.append(_table([dim, "n", "CR", "95% interval"], [[str(r["value"]), *_rate_cells(r)] for r in rows]))
    parts.append("</div>")
    parts.append(f'<h4>Hardest and easiest combinations</h4><p class="note">Combinations with at least '
                 f'{a["min_count"]} dialogues, ranked by CR.</p><div class=grid><div><b>hardest</b>'
                 f'{_combo_table(a["hardest"], dims)}</div><div><b>easiest</b>{_combo_table(a["easiest"], dims)}</div>'
                 '</div>')
    parts.append(f'<details><summary>all {len(a["by_combination"])} combinations</summary>'
                 f'{_combo_table(a["by_combination"], dims)}</details>')
    parts.append("<h4>CR by behaviour</h4>" + _table(
        ["category", "n", "CR", "95% interval"], [[_esc(r["category"]), *_rate_cells(r)] for r in a["by_behavior_category"]]))
    parts.append(f'<details><summary>all {len(a["by_behavior"])} behaviours</summary>' + _table(
        ["category", "behaviour", "n", "CR", "95% interval"],
        [[_esc(r["category"]), _esc(r["behavior"]), *_rate_cells(r)] for r in a["by_behavior"]], numeric_from=2)
        + "</details>")
    f = a["failures"]
    outcomes = [o for o, n in f["by_outcome"].items() if n]
    parts.append(f'<h4>Where failed calls end</h4><p>{f["n"]} dialogues did not complete: '
                 + ", ".join(f"{_esc(o)} {n}" for o, n in f["by_outcome"].items() if n)
                 + ". Highest SOP stage the agent reported:</p>")
    parts.append(_table(["stage", "name", "n", "share", *outcomes],
                        [[_esc(s["stage"]), _esc(s["name"]), str(s["n"]), f'{s["share"]:.3f}',
                          *(str(s["by_outcome"].get(o, 0)) for o in outcomes)] for s in f["by_stage"]],
                        numeric_from=2))
    w = a["recommended_weights"]
    cfg = w["config"]
    parts.append(f'<h4>Weights the controller\'s rule recommends</h4><p class="note">One StateController update '
                 f'from uniform weights with these {w["n"]} outcomes (target CR {cfg["target_completion_rate"]}, '
                 f'dead band {cfg["dead_band"]}, floor {cfg["floor"]}, max ratio {cfg["max_ratio"]}, '
                 f'smoothing 1); CR {_num(w["cr"])}, deviation {_num(w["deviation"])}.</p><div class=grid>')
    for group, weights in w["weights"].items():
        parts.append(_table([group, "weight"], [[_esc(k), f"{v:.3f}"] for k, v in weights.items()]))
    parts.append("</div>")
    return "\n".join(parts)


def analysis_html(analyses: Sequence[tuple[str, str, Mapping[str, Any]]]) -> str:
    """The mistakes analysis of each (split name, scope description, analyze_dialogues result)."""
    if not analyses:
        return '<p class="note">No dialogues to analyse (no rollout log or dialogues file).</p>'
    return "\n".join(_split_html(name, scope, a) for name, scope, a in analyses)
