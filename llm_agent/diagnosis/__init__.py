"""Turn-level diagnosis of dialogues: per-turn signals (what each agent turn did to the user and the call) and the
failure labels of the scenario's rules (SEAL-style), for records, logs, rewards, metrics and analyses.

`signals.py` computes the signals, `rules.py` applies one rule kind, `annotate.py` writes both into records and
counts the labels. The rules themselves live in the scenario YAML (`diagnosis:`, docs/scenario_schema.md).
"""
from llm_agent.diagnosis.annotate import (LABELS_KEY, annotate_record, annotated, diagnosis_metrics, label_names,
                                          turn_label_lists)
from llm_agent.diagnosis.rules import DIAGNOSED_OUTCOMES, apply_rule
from llm_agent.diagnosis.signals import SIGNAL_KEYS, turn_signals

__all__ = ["DIAGNOSED_OUTCOMES", "LABELS_KEY", "SIGNAL_KEYS", "annotate_record", "annotated", "apply_rule",
           "diagnosis_metrics", "label_names", "turn_label_lists", "turn_signals"]
