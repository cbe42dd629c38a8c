"""Judges: independent simulator sets that grade the same validation dialogues as the training simulator.

`rollout_loop.config.judges` maps a judge's name to its simulator instances' base URLs (a comma-separated string or
a list, checked like `user_sim.urls`); the validation loop then runs every validation batch once more per judge,
with the same agent prompts, profiles and simulator request seeds, through a client built like the training one
(`user_sim`'s other settings). A judge's dialogues are logged with split `val@<judge>` and its metrics are
`<judge>/<metric>` (the trainer adds `val/`). The exploitation gap is the training simulator's completion rate
minus the judge's: `<judge>/exploitation_gap` per judge and `exploitation_gap` against the mean of the judges'
(one judge: its gap). A gap that grows over training says the agent is learning the training simulator's quirks
(docs/simulator.md).
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from llm_agent.metrics import dialogue_metrics
from llm_agent.rollout.dialogue_record import DialogueRecord
from llm_agent.scenario import Scenario

__all__ = ["GAP_KEY", "JUDGE_NAME", "RESERVED", "check_judge_name", "judge_metrics", "judge_split", "parse_judge_urls"]

JUDGE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
"""A judge's name: it names a directory, a table row, a log split and the metric keys `val/<judge>/...`."""
GAP_KEY = "exploitation_gap"
CR_KEY = "completion_rate"
RESERVED = frozenset({"dialogue", "diagnosis", "user_sim", "reward", "test_score", "response_length", "rollout",
                      "generations", GAP_KEY})
"""Names a judge may not take: its metrics `val/<judge>/...` would mix with the trainer's own `val/` metrics."""


def check_judge_name(name: Any, where: str) -> str:
    """`name` when it is a valid judge name (`JUDGE_NAME`); ValueError naming `where` otherwise."""
    if not isinstance(name, str) or not JUDGE_NAME.fullmatch(name):
        raise ValueError(f"{where}: judge name {name!r} must be 1-64 letters, digits, '_' or '-', starting with a "
                         "letter or digit")
    if name in RESERVED:
        raise ValueError(f"{where}: judge name {name!r} is taken by validation's own metrics (val/{name}/...); "
                         "choose another")
    return name


def parse_judge_urls(judges: Mapping[Any, Any], where: str) -> dict[str, list[str]]:
    """{name: base URLs} of a `judges` mapping, each name checked and each URL list parsed like `user_sim.urls`
    (ValueError naming `where.<name>`)."""
    from llm_agent.user_sim.client import parse_urls

    out: dict[str, list[str]] = {}
    for name, urls in judges.items():
        check_judge_name(name, where)
        if not isinstance(urls, (str, list, tuple)):
            raise ValueError(f"{where}.{name} must be a comma-separated string or a list of URLs, got {urls!r}")
        try:
            out[name] = parse_urls(urls if isinstance(urls, str) else list(urls))
        except ValueError as exc:
            raise ValueError(f"{where}.{name}: {exc}") from None
    return out


def judge_split(name: str) -> str:
    """The rollout-log split of a judge's validation dialogues."""
    return f"val@{name}"


def judge_metrics(main: Sequence[DialogueRecord], judged: Mapping[str, Sequence[DialogueRecord]],
                  scenario: Scenario) -> dict[str, float]:
    """Every judge's dialogue metrics (`<judge>/<metric>`), its exploitation gap (`<judge>/exploitation_gap`) and
    the gap against the judges' mean completion rate (`exploitation_gap`); no gap where a CR is undefined."""
    main_cr = dialogue_metrics(list(main), scenario).get(CR_KEY)
    out: dict[str, float] = {}
    judge_crs = []
    for name, records in judged.items():
        raw = dialogue_metrics(list(records), scenario)
        out.update({f"{name}/{key}": value for key, value in raw.items()})
        cr = raw.get(CR_KEY)
        if cr is not None:
            judge_crs.append(cr)
            if main_cr is not None:
                out[f"{name}/{GAP_KEY}"] = main_cr - cr
    if main_cr is not None and judge_crs and len(judge_crs) == len(judged):
        out[GAP_KEY] = main_cr - sum(judge_crs) / len(judge_crs)
    return out
