"""The simulator report card: how well a user simulator (scripted, fine-tuned, or any hosted endpoint) plays the
scenario's users, measured on fixed probes or on logged dialogues.

`reference.py`: the scripted persona's reaction to a request (the reference). `checks.py`: the checks of one
reply (protocol, jump limits, direction, agreement, voiced doubts), also the simulator fine-tuning's filter.
`turns.py`: graded turns and their reconstruction from rollout logs. `probes.py`: the fixed probe set and running
a simulator on it. `card.py`: the metrics with bootstrap intervals, as JSON. `human.py`: the card's section on
human calls (how the scripted persona's and a simulator's answers agree with a person's turns). The command line is
`python -m for_evaluation.simulator_report`; the HTML section is `llm_agent.evaluation.report_simulator`.
"""
from llm_agent.simulator_report.card import METRIC_KEYS, build_card, card_metrics, score_dialogues
from llm_agent.simulator_report.checks import DoubtMatcher, ReplyCheck, ReplyChecker, jump_limits
from llm_agent.simulator_report.probes import (PROBE_SEED, ProbeSampling, ProbeSet, build_probe_set,
                                               run_probes)
from llm_agent.simulator_report.reference import Reference, ScriptedReference, carried_state
from llm_agent.simulator_report.turns import SimDialogue, SimTurn, dialogues_from_log

__all__ = ["METRIC_KEYS", "PROBE_SEED", "DoubtMatcher", "ProbeSampling", "ProbeSet", "Reference", "ReplyCheck",
           "ReplyChecker", "ScriptedReference", "SimDialogue", "SimTurn", "build_card", "build_probe_set",
           "card_metrics", "carried_state", "dialogues_from_log", "jump_limits", "run_probes", "score_dialogues"]
