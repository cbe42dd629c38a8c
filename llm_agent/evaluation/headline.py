"""The report's headline: the completion rate (CR) before and after training, each with its 95% interval.

From the dialogues: the first and the last validation (`analysis.before_after_groups`; an evaluation or a run
without validations has one group, its last step), CR = completed / non-error dialogues as in
`llm_agent.metrics`, with the interval the report's metrics table gives the same dialogues (a percentile
bootstrap over dialogues, `llm_agent.evaluation.stats`: one number, one interval on the page). Without
dialogues, the first and the last `val/dialogue/completion_rate` of the tracked metrics, without an interval
(the counts are not logged).
"""
from __future__ import annotations

import html
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from llm_agent.evaluation.analysis import before_after_groups
from llm_agent.metrics import NOT_AVAILABLE
from llm_agent.rollout.dialogue_record import DialogueRecord

__all__ = ["CRPoint", "IntervalOf", "cr_points", "headline_html"]

# The CR interval of a group of dialogues (None: none); the report passes its metrics table's bootstrap.
IntervalOf = Callable[[Sequence[DialogueRecord]], "tuple[float, float] | None"]

VAL_CR_KEY = "val/dialogue/completion_rate"


@dataclass(frozen=True)
class CRPoint:
    """The CR of one group of dialogues: its label, how many completed out of how many non-error dialogues, the
    CR (None when undefined: no non-error dialogue) and its 95% interval (None when unknown)."""

    label: str
    cr: float | None
    n: int | None = None
    completed: int | None = None
    interval: tuple[float, float] | None = None

    def text(self) -> str:
        """`0.281 [0.154, 0.451], 9/32` or `n/a` with why."""
        if self.cr is None:
            return f"{NOT_AVAILABLE} (every dialogue failed)"
        out = f"{self.cr:.3f}"
        if self.interval is not None:
            out += f" [{self.interval[0]:.3f}, {self.interval[1]:.3f}]"
        if self.n is not None:
            out += f", {self.completed}/{self.n}"
        return out


def _from_dialogues(label: str, records: Sequence[DialogueRecord], interval: IntervalOf | None) -> CRPoint:
    outcomes = [r.outcome for r in records]
    n = sum(o != "error" for o in outcomes)
    completed = sum(o == "completed" for o in outcomes)
    if n == 0:
        return CRPoint(label, None, 0, 0)
    return CRPoint(label, completed / n, n, completed, interval(records) if interval is not None else None)


def cr_points(dialogues: Sequence[DialogueRecord] | None, val_rows: Sequence[Mapping[str, float]],
              interval: IntervalOf | None = None) -> list[CRPoint]:
    """The headline's points, before then after (one point when there is nothing to compare); empty when the
    run has neither dialogues nor validation metrics. `interval` gives a group's CR interval (None: no
    intervals)."""
    if dialogues:
        return [_from_dialogues(label, records, interval) for label, records in before_after_groups(dialogues)]
    rows = [row for row in val_rows if VAL_CR_KEY in row]
    if not rows:
        return []
    ends = [rows[0], rows[-1]] if len(rows) > 1 else rows
    names = ["before: ", "after: "] if len(ends) > 1 else [""]
    return [CRPoint(f"{name}val, step {int(row['step'])}", float(row[VAL_CR_KEY])) for name, row in zip(names, ends)]


def headline_html(points: Sequence[CRPoint], interval_note: str = "") -> str:
    """The headline paragraph (escaped; empty when there are no points); `interval_note` says what the brackets
    are."""
    if not points:
        return ""
    parts = [f'<span class="cr-point" data-label="{html.escape(p.label, quote=True)}">'
             f'<span class="cr-label">{html.escape(p.label)}</span> <b class="cr-value">{html.escape(p.text())}</b>'
             '</span>' for p in points]
    change = ""
    if len(points) == 2 and None not in (points[0].cr, points[1].cr):
        change = f' <span class="cr-change">({points[1].cr - points[0].cr:+.3f})</span>'
    if any(p.interval is not None for p in points):
        note = f"brackets: {interval_note or '95% interval'}; completed / non-error dialogues"
    elif any(p.n is not None for p in points):
        note = "completed / non-error dialogues; no interval (bootstrap off)"
    else:
        note = "no interval: the dialogues were not logged"
    return (f'<p id="headline" class="headline">Completion rate (CR): {" &rarr; ".join(parts)}{change}'
            f'<br><span class="note">{html.escape(note)}</span></p>')
