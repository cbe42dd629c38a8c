"""Dialogue records annotated with per-turn signals and failure labels, the labels as the trainer's `turn_labels`,
and the per-step label counts.

`annotate_record` adds to every turn of a record its `signals` (`llm_agent.diagnosis.signals`) and its
`diagnosis`: a list of `{"label", "note"}`, one per label the scenario's rules put on the turn (`rules.py`), and to
the record `labels`: {label: number of its turns carrying it}. The rollout loop annotates every dialogue it
returns, so the rollout log, the evaluation's dialogue files, the report and analyze_mistakes read the same
labels; records written before this existed are annotated when read (`annotated`).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from typing import Any

from llm_agent.diagnosis.rules import DIAGNOSED_OUTCOMES, apply_rule
from llm_agent.diagnosis.signals import turn_signals
from llm_agent.metrics import record_label, record_outcome, record_turns
from llm_agent.scenario import Scenario

__all__ = ["LABELS_KEY", "annotate_record", "annotated", "diagnosis_metrics", "label_names", "turn_label_lists"]

LABELS_KEY = "labels"  # the record's {label: turns} summary


def label_names(scenario: Scenario) -> tuple[str, ...]:
    """The labels the scenario's rules can give, in file order."""
    return tuple(rule.label for rule in scenario.diagnosis)


def diagnose(record: Mapping[str, Any], scenario: Scenario, signals: Sequence[Mapping[str, Any]],
             where: str = "dialogue") -> list[list[dict[str, str]]]:
    """Per turn of `record`, the `{"label", "note"}` entries of the scenario's rules (one per label and turn)."""
    turns = record_turns(record, where)
    outcome = record_outcome(record, where)
    per_turn: list[dict[str, list[str]]] = [{} for _ in turns]
    for rule in scenario.diagnosis:
        for k, note in apply_rule(rule, turns, signals, outcome):
            per_turn[k].setdefault(rule.label, []).append(note)
    return [[{"label": label, "note": "; ".join(notes)} for label, notes in found.items()] for found in per_turn]


def annotate_record(record: MutableMapping[str, Any], scenario: Scenario, where: str = "dialogue") -> None:
    """Set every turn's `signals` and `diagnosis` and the record's `labels` (in place; see the module docstring)."""
    turns = record_turns(record, where)
    signals = turn_signals(record, scenario, where)
    labels = diagnose(record, scenario, signals, where)
    counts: dict[str, int] = {}
    for turn, signal, found in zip(turns, signals, labels):
        turn["signals"], turn["diagnosis"] = signal, found
        for entry in found:
            counts[entry["label"]] = counts.get(entry["label"], 0) + 1
    record[LABELS_KEY] = counts


def annotated(records: Iterable[Mapping[str, Any]], scenario: Scenario) -> list[Mapping[str, Any]]:
    """`records`, each annotated when it is not already (a copy then: the caller's records are not changed)."""
    out = []
    for i, record in enumerate(records):
        turns = record.get("turns") or []
        if LABELS_KEY in record and all("signals" in t and "diagnosis" in t for t in turns):
            out.append(record)
            continue
        copy = {**record, "turns": [dict(t) for t in turns]}
        annotate_record(copy, scenario, record_label(record, i))
        out.append(copy)
    return out


def turn_label_lists(record: Mapping[str, Any]) -> list[list[str]]:
    """The label names of every turn of an annotated record (the trainer's `turn_labels` entry of its row)."""
    return [[entry["label"] for entry in turn.get("diagnosis") or ()] for turn in record.get("turns") or ()]


def diagnosis_metrics(records: Sequence[Mapping[str, Any]], scenario: Scenario) -> dict[str, float]:
    """Label counts of annotated records: `diagnosis/labels/<label>` (turns carrying it, every label of the
    scenario's rules, 0 included) and `diagnosis/labelled_failure_frac` (the share of dialogues that did not
    complete, simulator errors aside, with at least one label; 0 when there were none)."""
    counts = {label: 0 for label in label_names(scenario)}
    failures = labelled = 0
    for record in records:
        found = record.get(LABELS_KEY) or {}
        for label, turns in found.items():
            counts[label] = counts.get(label, 0) + int(turns)
        if record.get("outcome") in DIAGNOSED_OUTCOMES:
            failures += 1
            labelled += bool(found)
    metrics = {f"diagnosis/labels/{label}": float(n) for label, n in counts.items()}
    metrics["diagnosis/labelled_failure_frac"] = labelled / failures if failures else 0.0
    return metrics
