"""Dialogue records annotated with per-turn signals and failure labels, the labels as the trainer's `turn_labels`,
and the per-step label counts.

`annotate_record` sets on every turn of a `DialogueRecord` its `signals` (`llm_agent.diagnosis.signals`) and its
`diagnosis`: a list of `{"label", "note"}`, one per label the scenario's rules put on the turn (`rules.py`), and on
the record `labels`: {label: number of its turns carrying it}. The rollout loop annotates every dialogue it
returns, so the rollout log, the evaluation's dialogue files, the report and analyze_mistakes read the same
labels; records written before this existed are annotated when read (`annotated`).
"""
from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence

from llm_agent.diagnosis.rules import DIAGNOSED_OUTCOMES, apply_rule
from llm_agent.diagnosis.signals import turn_signals
from llm_agent.metrics import record_label
from llm_agent.rollout.dialogue_record import DialogueRecord, TurnSignals
from llm_agent.scenario import Scenario

__all__ = ["LABELS_KEY", "annotate_record", "annotated", "diagnosis_metrics", "label_names", "turn_label_lists"]

LABELS_KEY = "labels"  # the record's {label: turns} summary (its log key)


def label_names(scenario: Scenario) -> tuple[str, ...]:
    """The labels the scenario's rules can give, in file order."""
    return tuple(rule.label for rule in scenario.diagnosis)


def diagnose(record: DialogueRecord, scenario: Scenario, signals: Sequence[TurnSignals]) -> list[list[dict[str, str]]]:
    """Per turn of `record`, the `{"label", "note"}` entries of the scenario's rules (one per label and turn)."""
    per_turn: list[dict[str, list[str]]] = [{} for _ in record.turns]
    for rule in scenario.diagnosis:
        for k, note in apply_rule(rule, record.turns, signals, record.outcome, scenario.state_schema):
            per_turn[k].setdefault(rule.label, []).append(note)
    return [[{"label": label, "note": "; ".join(notes)} for label, notes in found.items()] for found in per_turn]


def annotate_record(record: DialogueRecord, scenario: Scenario, where: str = "dialogue") -> None:
    """Set every turn's `signals` and `diagnosis` and the record's `labels` (in place; see the module docstring)."""
    signals = turn_signals(record, scenario, where)
    labels = diagnose(record, scenario, signals)
    counts: dict[str, int] = {}
    for turn, signal, found in zip(record.turns, signals, labels):
        turn.signals, turn.diagnosis = signal, found
        for entry in found:
            counts[entry["label"]] = counts.get(entry["label"], 0) + 1
    record.labels = counts


def annotated(records: Iterable[DialogueRecord], scenario: Scenario) -> list[DialogueRecord]:
    """`records`, each annotated when it is not already (a copy then: the caller's records are not changed)."""
    out = []
    for i, record in enumerate(records):
        if record.annotated:
            out.append(record)
            continue
        record = copy.deepcopy(record)
        annotate_record(record, scenario, record_label(record, i))
        out.append(record)
    return out


def turn_label_lists(record: DialogueRecord) -> list[list[str]]:
    """The label names of every turn of an annotated record (the trainer's `turn_labels` entry of its row)."""
    return [[entry["label"] for entry in turn.diagnosis or ()] for turn in record.turns]


def diagnosis_metrics(records: Sequence[DialogueRecord], scenario: Scenario) -> dict[str, float]:
    """Label counts of annotated records: `diagnosis/labels/<label>` (turns carrying it, every label of the
    scenario's rules, 0 included) and `diagnosis/labelled_failure_frac` (the share of dialogues that did not
    complete, simulator errors aside, with at least one label; 0 when there were none)."""
    counts = {label: 0 for label in label_names(scenario)}
    failures = labelled = 0
    for record in records:
        found = record.labels or {}
        for label, turns in found.items():
            counts[label] = counts.get(label, 0) + int(turns)
        if record.outcome in DIAGNOSED_OUTCOMES:
            failures += 1
            labelled += bool(found)
    metrics = {f"diagnosis/labels/{label}": float(n) for label, n in counts.items()}
    metrics["diagnosis/labelled_failure_frac"] = labelled / failures if failures else 0.0
    return metrics
