"""The simulator report cards as HTML: a section of the run report, or a page of their own.

`simulator_html(cards)` puts simulator report cards (`llm_agent.simulator_report.build_card` JSON) side by side:
one row per metric, one column per card, each value with its bootstrap interval, then what each card measured
and a few of its failing replies; `human_html(cards)` the agreement with people's turns of cards graded on
human calls. `render_simulator_page(cards)` wraps it in a self-contained page with the run
report's stylesheet. Every value from a card is escaped.
"""
from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

from llm_agent.evaluation.page_text import esc as _esc
from llm_agent.simulator_report.card import METRIC_KEYS

__all__ = ["HUMAN_NOTES", "METRIC_NOTES", "human_html", "render_simulator_page", "simulator_html"]

METRIC_NOTES = {
    "first_try_valid_rate": "first reply in the exact tag protocol",
    "first_try_accepted_rate": "first reply taken by the rollout loop (no re-request)",
    "rerequest_rate": "turns that needed a re-request",
    "rerequests_per_turn": "re-requests per turn",
    "failed_rate": "turns with no acceptable reply",
    "control_text_rate": "turns with a reply holding chat-template control text (<|im_start|>, </s>, ...)",
    "format_valid_rate": "the reply used is in the exact tag protocol",
    "jump_within_limits_rate": "state moved within the scenario's per-turn limits",
    "direction_consistent_rate": "no dimension moved against the agent's turn",
    "scripted_direction_agreement": "same direction of change as the scripted persona, all dimensions",
    "scripted_state_agreement": "same new state as the scripted persona",
    "scripted_status_agreement": "same status as the scripted persona",
    "behaviour_adherence": "profile behaviours voiced where the scripted persona voices them",
    "latency_p50_s": "median seconds per request",
    "latency_p95_s": "95th percentile seconds per request",
    "distinct_1": "distinct words per word of the replies",
    "distinct_2": "distinct word pairs per word pair",
    "unique_reply_rate": "distinct replies per reply",
}


def _num(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "–"


def _cell(value: Any) -> str:
    if isinstance(value, Mapping):
        return (f'{_num(value.get("value"))} <span class="ci">[{_num(value.get("low"))}, '
                f'{_num(value.get("high"))}]</span>')
    return _num(value)


def _source(card: Mapping[str, Any]) -> str:
    source = card.get("source") or {}
    parts = ", ".join(f"{_esc(k)}: {_esc(v)}" for k, v in source.items() if not isinstance(v, Mapping))
    probes = source.get("probes") if isinstance(source.get("probes"), Mapping) else None
    probe_text = (f"; probes: {_esc(probes.get('dialogues'))} dialogues, {_esc(probes.get('requests'))} requests, "
                  f"seed {_esc(probes.get('seed'))}") if probes else ""
    return (f"<li><b>{_esc(card.get('name'))}</b>: {parts}{probe_text}; {_esc(card.get('n_turns'))} turns in "
            f"{_esc(card.get('n_dialogues'))} dialogues; requests fingerprint "
            f"<code>{_esc(str(card.get('probe_fingerprint', ''))[:12])}</code></li>")


def _examples(card: Mapping[str, Any]) -> str:
    examples = card.get("examples") or {}
    items = []
    for kind, rows in examples.items():
        for row in rows or []:
            items.append(f"<li><code>{_esc(kind)}</code> {_esc(row.get('dialogue_id'))} turn "
                         f"{_esc(row.get('turn'))}: <code>{_esc(row.get('reply'))}</code></li>")
    if not items:
        return ""
    return (f"<details><summary>{_esc(card.get('name'))}: {len(items)} example(s) of failing replies</summary>"
            f"<ul>{''.join(items)}</ul></details>")


def _get(value: Any, key: str) -> Any:
    return value.get(key) if isinstance(value, Mapping) else None


def _items(value: Any) -> list[tuple[Any, Any]]:
    return list(value.items()) if isinstance(value, Mapping) else []


HUMAN_NOTES = {
    "format_valid_rate": "the answer was in the exact tag protocol",
    "state_agreement": "the same new state as the person, all dimensions",
    "direction_agreement": "the same direction of change as the person, all dimensions",
    "status_agreement": "the same status as the person (continue, agreed, hung up)",
}


def human_html(cards: Sequence[Mapping[str, Any]]) -> str:
    """The agreement with the person's turns of each card graded on human calls (its `human` section), one
    column per card and preview source; empty when no card has one."""
    columns = [(c, source, part) for c in cards if isinstance(c.get("human"), Mapping)
               and isinstance(c["human"].get("sources"), Mapping)
               for source, part in c["human"]["sources"].items() if isinstance(part, Mapping)]
    if not columns:
        return ""
    head = "".join(f'<th class="num">{_esc(c.get("name"))}: {_esc(source)}</th>' for c, source, _ in columns)
    keys = list(dict.fromkeys(k for _, _, part in columns if isinstance(part.get("metrics"), Mapping)
                              for k in part["metrics"]))
    counts = "".join(f'<td class="num">{_esc(part.get("n_turns"))} ({_esc(part.get("n_errors"))} failed)</td>'
                     for _, _, part in columns)
    rows = [f"<tr><td>person turns answered</td>{counts}</tr>"]
    for key in keys:
        cells = "".join(f'<td class="num">{_cell(_get(part.get("metrics"), key))}</td>' for _, _, part in columns)
        rows.append(f"<tr><td><code>{_esc(key)}</code> <span class=note>"
                    f"{_esc(HUMAN_NOTES.get(str(key).split('/')[0], ''))}</span></td>{cells}</tr>")
    pairs = "".join(f"<td>{_esc(', '.join(f'{k}: {v}' for k, v in _items(part.get('status_pairs'))))}</td>"
                    for _, _, part in columns)
    rows.append(f"<tr><td>status, person->answer: turns</td>{pairs}</tr>")
    calls = "; ".join(f"{_esc(c.get('name'))}: {_esc(c['human'].get('n_calls'))} calls, "
                      f"{_esc(c['human'].get('n_person_turns'))} person turns"
                      for c in cards if isinstance(c.get("human"), Mapping))
    return (f'<h3 id="simulator-human">Agreement with people</h3><table class="human-agreement"><thead><tr>'
            f"<th>metric</th>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
            '<p class="note">Human calls (<code>python -m for_evaluation.chat</code>): what the scripted persona and '
            "the configured simulator answered to the same request as the person, against the person's turn "
            f"(llm_agent/simulator_report/human.py); intervals over calls. {calls}</p>")


def simulator_html(cards: Sequence[Mapping[str, Any]]) -> str:
    """The report cards side by side (see the module docstring); a note when there are none."""
    if not cards:
        return ('<p class="note">No simulator report card. Make one with <code>python -m '
                'for_evaluation.simulator_report</code> and pass it with <code>--simulator-card FILE</code>.</p>')
    head = "".join(f'<th class="num">{_esc(c.get("name"))}</th>' for c in cards)
    rows = []
    for key in METRIC_KEYS:
        cells = "".join(f'<td class="num">{_cell((c.get("metrics") or {}).get(key))}</td>' for c in cards)
        rows.append(f"<tr><td><code>{_esc(key)}</code> <span class=note>{_esc(METRIC_NOTES.get(key, ''))}"
                    f"</span></td>{cells}</tr>")
    table = f"<table><thead><tr><th>metric</th>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
    sources = "<ul class=note>" + "".join(_source(c) for c in cards) + "</ul>"
    note = ('<p class="note">Each turn is graded against the scenario\'s scripted persona answering the same request '
            "(llm_agent/simulator_report). Brackets: percentile bootstrap intervals over dialogues; – not "
            "measurable (first-try checks and latency of logged dialogues).</p>")
    return table + note + sources + human_html(cards) + "".join(_examples(c) for c in cards)


def render_simulator_page(cards: Sequence[Mapping[str, Any]], title: str = "SEAD simulator report") -> str:
    """A self-contained HTML page holding `simulator_html(cards)`."""
    css = resources.files("llm_agent.evaluation").joinpath("report_assets", "report.css").read_text(encoding="utf-8")
    generated = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    scenarios = sorted({str(c.get("scenario")) for c in cards})
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_esc(title)}</title>'
            f"<style>{css}</style></head><body><header><h1>{_esc(title)}</h1><div class=sources>scenario "
            f"{_esc(', '.join(scenarios))} · {len(cards)} simulator(s) · generated {generated}</div></header>"
            f'<main><section id="simulator"><h2>User simulator</h2>{simulator_html(cards)}</section></main>'
            "</body></html>\n")
