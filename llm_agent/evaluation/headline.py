"""The report's headline: the completion rate (CR) before and after training, each with its 95% interval.

From the dialogues: the first and the last validation (`analysis.before_after_groups`; an evaluation or a run
without validations has one group, its last step), CR = completed / non-error dialogues as in
`llm_agent.metrics`, with the interval the report's metrics table gives the same dialogues (a percentile
bootstrap over dialogues, `llm_agent.evaluation.stats`: one number, one interval on the page). Without
dialogues, the first and the last `val/dialogue/completion_rate` of the tracked metrics, without an interval
(the counts are not logged).

When validation ran judges (`rollout_loop.config.judges`), a second line gives the exploitation gap at the last
validation: the training simulator's CR minus each judge's, on the same profiles, with the paired bootstrap
interval of `llm_agent.evaluation.stats.paired_comparison` (from the dialogues of splits `val` and
`val@<judge>`), else the last tracked `val/exploitation_gap` without an interval.
"""
from __future__ import annotations

import html
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from llm_agent.evaluation.analysis import before_after_groups
from llm_agent.metrics import NOT_AVAILABLE
from llm_agent.rollout.dialogue_record import DialogueRecord

__all__ = ["CRPoint", "GapPoint", "IntervalOf", "cr_points", "gap_points", "headline_html"]

# The CR interval of a group of dialogues (None: none); the report passes its metrics table's bootstrap.
IntervalOf = Callable[[Sequence[DialogueRecord]], "tuple[float, float] | None"]

VAL_CR_KEY = "val/dialogue/completion_rate"
VAL_GAP_KEY = "val/exploitation_gap"
JUDGE_SPLIT = "val@"  # a judge's validation dialogues: split `val@<judge>`
# The paired CR difference of two groups of dialogues: (value, interval or None), None when they share no profile.
GapOf = Callable[[Sequence[DialogueRecord], Sequence[DialogueRecord]],
                 "tuple[float, tuple[float, float] | None] | None"]


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


@dataclass(frozen=True)
class GapPoint:
    """The exploitation gap against one judge (`judge` None: the tracked gap against the judges' mean CR) at
    validation step `step`: training simulator's CR minus the judge's, with its paired interval (None: unknown)."""

    judge: str | None
    step: int
    gap: float
    interval: tuple[float, float] | None = None

    def text(self) -> str:
        """`vs persona at val step 16: +0.125 [0.031, 0.219]`."""
        against = f"vs {self.judge}" if self.judge else "vs the judges' mean"
        bracket = "" if self.interval is None else f" [{self.interval[0]:+.3f}, {self.interval[1]:+.3f}]"
        return f"{against} at val step {self.step}: {self.gap:+.3f}{bracket}"


def gap_points(dialogues: Sequence[DialogueRecord] | None, val_rows: Sequence[Mapping[str, float]],
               paired: GapOf) -> list[GapPoint]:
    """The exploitation gap per judge at the last validation step that has judged dialogues (`paired` gives the
    paired CR difference), else the last tracked `val/exploitation_gap`; empty without judges."""
    by_split: dict[str, dict[int, list[DialogueRecord]]] = {}
    for d in dialogues or ():
        if isinstance(d.step, int) and (d.split == "val" or str(d.split).startswith(JUDGE_SPLIT)):
            by_split.setdefault(str(d.split), {}).setdefault(d.step, []).append(d)
    judged_steps = {s for split, steps in by_split.items() if split != "val" for s in steps}
    steps = sorted(judged_steps.intersection(by_split.get("val", {})))
    if steps:
        out = []
        for split in sorted(s for s in by_split if s != "val" and steps[-1] in by_split[s]):
            result = paired(by_split["val"][steps[-1]], by_split[split][steps[-1]])
            if result is not None:
                out.append(GapPoint(split[len(JUDGE_SPLIT):], steps[-1], result[0], result[1]))
        return out
    rows = [row for row in val_rows if VAL_GAP_KEY in row]
    return [GapPoint(None, int(rows[-1]["step"]), float(rows[-1][VAL_GAP_KEY]))] if rows else []


def headline_html(points: Sequence[CRPoint], interval_note: str = "", gaps: Sequence[GapPoint] = ()) -> str:
    """The headline paragraph (escaped; empty when there are no points); `interval_note` says what the brackets
    are; `gaps` adds the exploitation gap line."""
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
    gap_line = ""
    if gaps:
        gap_line = ('<br><span class="gap">Exploitation gap (CR under the training simulator minus under the judge, '
                    'paired by profile; docs/simulator.md): '
                    + "; ".join(f'<b class="gap-value">{html.escape(g.text())}</b>' for g in gaps) + "</span>")
    return (f'<p id="headline" class="headline">Completion rate (CR): {" &rarr; ".join(parts)}{change}'
            f'{gap_line}<br><span class="note">{html.escape(note)}</span></p>')
