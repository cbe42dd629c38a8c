"""Evaluation of trained agents: running the fixed test set (`runner`, `agents`, `sims`), statistics over
dialogues (`stats`), the comparison table (`table`), and the plots, report and mistakes analysis.

Thin command lines live in `for_evaluation/` (`evaluate.py`, `metrics_table.py`, ...).
"""
