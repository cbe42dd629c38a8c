"""Mistakes analysis of dialogues (the original SEAD's analyze_chatbot_mistakes): where the agent fails.

Over the dialogue records of a rollout log or an evaluation (`run_data.read_dialogues`), per split:
completion rate (CR) per initial-state value and per combination of values (the scenario's state dimensions) with
counts and Wilson 95% intervals, the hardest and easiest combinations, CR per behaviour and behaviour category, where
the failed calls ended (highest SOP stage the agent reported, and the outcome), why they failed (the failure
labels of the scenario's diagnosis rules, `llm_agent.diagnosis`: per label the turns and calls carrying it, its
share of the failed calls, by outcome, and its most frequent notes, e.g. which doubt categories went unanswered),
and the sampling weights the state controller's rule would set from these outcomes (computed by
`llm_agent.controller.StateController` itself). As in `llm_agent.metrics`, dialogues with outcome `error` are
counted but left out of every CR.
"""
from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import yaml

from llm_agent.controller import ControllerConfig, StateController
from llm_agent.diagnosis import DIAGNOSED_OUTCOMES, annotated, label_names
from llm_agent.metrics import OUTCOMES, record_label
from llm_agent.rollout.dialogue_record import DialogueRecord, TurnRecord
from llm_agent.scenario import Scenario

__all__ = ["Z_95", "analyze_by_split", "analyze_dialogues", "before_after_groups", "cr_by_dimension", "failure_labels",
           "highest_stage", "parse_controller_overrides", "rate", "wilson_interval"]

Z_95 = 1.959963984540054  # two-sided 95% normal quantile
NO_STAGE = "none"


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion; (0, 1) when n is 0."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    low = 0.0 if successes == 0 else max(0.0, centre - half)  # exact at the ends, where rounding leaves 1e-17
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


def rate(completed: int, n: int) -> dict[str, float]:
    """{"n", "completed", "cr", "ci_low", "ci_high"} of `completed` out of `n` (cr 0 when n is 0)."""
    low, high = wilson_interval(completed, n)
    return {"n": n, "completed": completed, "cr": completed / n if n else 0.0, "ci_low": low, "ci_high": high}


def highest_stage(turns: Sequence[TurnRecord], stage_ids: Sequence[int]) -> int | None:
    """The latest SOP stage (in the scenario's order) the agent reported in any turn; None when it reported none
    or only ids that are not the scenario's."""
    order = {sid: i for i, sid in enumerate(stage_ids)}
    reached = [order[t.agent_stage] for t in turns if t.agent_stage in order]
    return stage_ids[max(reached)] if reached else None


def before_after_groups(dialogues: Sequence[DialogueRecord]) -> list[tuple[str, list[DialogueRecord]]]:
    """(label, dialogues) to compare by initial state: the first and the last validation (before and after
    training) side by side; without validations an evaluation's last step, else the last training step. Steps
    are never pooled: each validation meets the same users with a different policy."""
    by_split: dict[str, dict[Any, list[DialogueRecord]]] = {}
    for d in dialogues:
        by_split.setdefault(str(d.split or "all"), {}).setdefault(d.step, []).append(d)

    def ordered(split: str) -> list[Any]:
        return sorted(by_split[split], key=lambda s: (not isinstance(s, int), s if isinstance(s, int) else 0))

    if "val" in by_split:
        steps = ordered("val")
        if len(steps) == 1:
            return [(f"val, step {steps[0]}", by_split["val"][steps[0]])]
        return [(f"before: val, step {steps[0]}", by_split["val"][steps[0]]),
                (f"after: val, step {steps[-1]}", by_split["val"][steps[-1]])]
    split = "eval" if "eval" in by_split else "train" if "train" in by_split else sorted(by_split)[0]
    last = ordered(split)[-1]
    return [(f"{split}, step {last}" if last is not None else split, by_split[split][last])]


def cr_by_dimension(records: Iterable[DialogueRecord], dims: Sequence[str]) -> dict[str, list[dict[str, float]]]:
    """{dimension of `dims`: [{"value", "n", "completed", "cr", "ci_low", "ci_high"}, ...] by value} over the
    non-error records (their profile's initial state)."""
    tallies: dict[str, dict[int, list[int]]] = {d: defaultdict(lambda: [0, 0]) for d in dims}
    for i, record in enumerate(records):
        if record.outcome == "error":
            continue
        state = record.initial_state(dims, record_label(record, i))
        for dim in dims:
            tally = tallies[dim][state[dim]]
            tally[0] += record.outcome == "completed"
            tally[1] += 1
    return {dim: [{"value": v, **rate(done, n)} for v, (done, n) in sorted(tallies[dim].items())] for dim in dims}


def failure_labels(records: Sequence[DialogueRecord], scenario: Scenario, top_notes: int = 5) -> dict[str, Any]:
    """Why the calls failed: {"failed", "labelled", "labels": [{"label", "turns", "dialogues", "share",
    "by_outcome", "notes"}]} over the failed (not completed, not error) annotated records; `share` is the label's
    share of the failed calls and `notes` its `top_notes` most frequent notes with their turn counts. Labels in
    the scenario's file order, then any others found in the records."""
    failed = [r for r in records if r.outcome in DIAGNOSED_OUTCOMES]
    turns: Counter = Counter()
    dialogues: Counter = Counter()
    outcomes: dict[str, Counter] = defaultdict(Counter)
    notes: dict[str, Counter] = defaultdict(Counter)
    for record in failed:
        seen = set()
        for turn in record.turns:
            for entry in turn.diagnosis or ():
                label = entry["label"]
                turns[label] += 1
                seen.add(label)
                for note in str(entry.get("note", "")).split("; "):
                    notes[label][note] += 1
        for label in seen:
            dialogues[label] += 1
            outcomes[label][record.outcome] += 1
    order = [*label_names(scenario), *sorted(set(turns) - set(label_names(scenario)))]
    return {"failed": len(failed), "labelled": sum(1 for r in failed if r.labels),
            "labels": [{"label": label, "turns": turns[label], "dialogues": dialogues[label],
                        "share": dialogues[label] / len(failed) if failed else 0.0,
                        "by_outcome": dict(sorted(outcomes[label].items())),
                        "notes": dict(notes[label].most_common(top_notes))} for label in order]}


def _tally_rates(tallies: Mapping[Any, list[int]]) -> dict[Any, dict[str, float]]:
    return {key: rate(done, n) for key, (done, n) in tallies.items()}


def _ranked(combos: list[dict[str, Any]], min_count: int, top_k: int, hardest: bool) -> list[dict[str, Any]]:
    eligible = [c for c in combos if c["n"] >= min_count]
    if hardest:
        return sorted(eligible, key=lambda c: (c["cr"], c["ci_high"], c["state_key"]))[:top_k]
    return sorted(eligible, key=lambda c: (-c["cr"], -c["ci_low"], c["state_key"]))[:top_k]


def _recommended_weights(outcomes: list[tuple[str, bool]], scenario: Scenario,
                         controller: Mapping[str, Any] | None) -> dict[str, Any]:
    """The weights one controller update from uniform would set, with smoothing 1 (the rule's own target,
    bounded by the floor and max_ratio), by StateController's code."""
    config = ControllerConfig.from_dict({**(controller or {}), "smoothing": 1.0}, where="controller")
    ctl = StateController(config, scenario)
    metrics = ctl.update(outcomes)
    return {"config": asdict(config), "n": len(outcomes), "cr": metrics.get("controller/cr"),
            "deviation": metrics.get("controller/deviation"), "weights": ctl.weights}


def analyze_dialogues(records: Sequence[DialogueRecord], scenario: Scenario, *,
                      controller: Mapping[str, Any] | None = None, min_count: int = 5,
                      top_k: int = 5) -> dict[str, Any]:
    """The analysis of the module docstring over `records` as a JSON-ready dict.

    `controller` overrides ControllerConfig keys for the recommended weights (smoothing is always 1);
    `min_count` is the least number of dialogues a combination needs to be ranked hardest or easiest.
    A record's profile must hold the scenario's dimensions; ValueError naming the record otherwise. Records
    without failure labels (logs written before them) are diagnosed with the scenario's rules.
    """
    records = annotated(records, scenario)
    schema = scenario.state_schema
    by_combo: dict[tuple[int, ...], list[int]] = defaultdict(lambda: [0, 0])
    by_behavior: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    by_category: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    failures: dict[int | None, Counter] = defaultdict(Counter)
    outcome_counts: Counter = Counter()
    controller_outcomes: list[tuple[str, bool]] = []
    for i, record in enumerate(records):
        outcome = record.outcome
        outcome_counts[outcome] += 1
        if outcome == "error":
            continue
        initial = record.initial_state(schema.names, record_label(record, i))
        done = outcome == "completed"
        state = tuple(initial[d] for d in schema.names)
        behaviors = record.profile.get("behaviors") or []
        for tally in [by_combo[state]] + [by_behavior[(b.get("category", "?"), b.get("behavior", "?"))]
                                          for b in behaviors]:
            tally[0], tally[1] = tally[0] + done, tally[1] + 1
        for category in {b.get("category", "?") for b in behaviors}:
            by_category[category][0] += done
            by_category[category][1] += 1
        controller_outcomes.append((schema.key(state), done))
        if not done:
            failures[highest_stage(record.turns, scenario.stage_ids)][outcome] += 1
    scored = len(controller_outcomes)
    completed = sum(done for _, done in controller_outcomes)
    combos = [{"state_key": schema.key(state), **schema.state(state), **r}
              for state, r in sorted(_tally_rates(by_combo).items())]
    stage_names = {s.id: s.name for s in scenario.stages}
    n_failed = sum(sum(c.values()) for c in failures.values())
    stage_rows = []
    for stage in [*scenario.stage_ids, None]:
        if stage in failures:
            count = sum(failures[stage].values())
            stage_rows.append({"stage": NO_STAGE if stage is None else stage,
                               "name": "no stage reported" if stage is None else stage_names[stage],
                               "n": count, "share": count / n_failed,
                               "by_outcome": {o: failures[stage][o] for o in OUTCOMES if failures[stage][o]}})
    return {
        "n_dialogues": len(records), "n_errors": outcome_counts["error"], "n_scored": scored,
        "outcomes": {o: outcome_counts[o] for o in OUTCOMES},
        "completion": rate(completed, scored),
        "dimensions": list(schema.names),
        "by_dimension": cr_by_dimension(records, schema.names),
        "by_combination": combos,
        "hardest": _ranked(combos, min_count, top_k, hardest=True),
        "easiest": _ranked(combos, min_count, top_k, hardest=False),
        "min_count": min_count,
        "by_behavior": sorted(({"category": c, "behavior": b, **r} for (c, b), r in _tally_rates(by_behavior).items()),
                              key=lambda x: (x["cr"], x["category"], x["behavior"])),
        "by_behavior_category": sorted(({"category": c, **r} for c, r in _tally_rates(by_category).items()),
                                       key=lambda x: (x["cr"], x["category"])),
        "failures": {"n": n_failed,
                     "by_outcome": {o: sum(c[o] for c in failures.values()) for o in OUTCOMES
                                    if o not in ("completed", "error")},
                     "by_stage": stage_rows},
        "diagnosis": failure_labels(records, scenario),
        "recommended_weights": _recommended_weights(controller_outcomes, scenario, controller),
    }


def parse_controller_overrides(items: Sequence[str]) -> dict[str, Any]:
    """["key=value", ...] (command-line overrides of ControllerConfig keys) as a dict, values read as YAML
    scalars; ValueError naming an item without "=". The keys are checked by ControllerConfig.from_dict."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"a controller override must be KEY=VALUE, got {item!r}")
        out[key.strip()] = yaml.safe_load(value)
    return out


def analyze_by_split(records: Iterable[DialogueRecord], scenario: Scenario, *, split: str | None = None,
                     min_step: int | None = None, max_step: int | None = None, **kwargs: Any) -> dict[str, Any]:
    """{"scenario", "splits": {split: analyze_dialogues(...)}} over records grouped by their `split` field
    ("all" when a record has none), optionally one split and a step range only (inclusive)."""
    groups: dict[str, list[DialogueRecord]] = defaultdict(list)
    for record in records:
        step = record.step
        if min_step is not None and (step is None or step < min_step):
            continue
        if max_step is not None and (step is None or step > max_step):
            continue
        groups[str(record.split or "all")].append(record)
    if split is not None:
        if split not in groups:
            raise ValueError(f"no dialogues of split {split!r} (splits present: {sorted(groups) or 'none'})")
        groups = {split: groups[split]}
    return {"scenario": scenario.name,
            "splits": {name: analyze_dialogues(rows, scenario, **kwargs) for name, rows in sorted(groups.items())}}
