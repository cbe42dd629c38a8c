"""The failure-diagnosis rules: which agent turns of a dialogue that did not complete show which failure pattern.

Each rule kind of `llm_agent.scenario.RULE_KINDS` is one function here, reading the record's turns, their
signals (`llm_agent.diagnosis.signals`) and the rule's parameters from the scenario YAML. For turn k (0-based):

- `unanswered_doubt`: the user's reply to turn k-1 hits a doubt category's `raised` cues and turn k's spoken reply
  hits none of its `answered` cues (note: the category);
- `false_claim`: the agent's status on turn k is `completed` and the user did not complete in answer, or its reply
  hits a `claims` cue (the call did not complete, so any claim of success was false);
- `premature_push`: turn k's reply hits a `push` cue while the user was not `ready`: a dimension worse than its
  `ready` value (below it, or above it where lower is better) in the state the user reported after the turn (the
  state before it when nothing was reported);
- `drop_before_hang_up`: the user hung up, and turn k is one of the last `window` turns and worsened one of the
  `dimensions` by at least `drop` (lowered it, or raised it where lower is better);
- `format_error`: turn k broke the tag protocol;
- `loop_to_timeout`: the call ran out of turns, and turn k comes after the last turn that moved it on (reached a
  further stage or raised the user's state); every turn when none did;
- `truncated`: the token budget ran out in turn k, the last one.

Completed dialogues and simulator errors get no labels.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from llm_agent.rollout.dialogue_record import HUMAN_USER_SOURCE, TurnRecord, TurnSignals
from llm_agent.scenario import DiagnosisRule, StateSchema

__all__ = ["DIAGNOSED_OUTCOMES", "Finding", "apply_rule"]

DIAGNOSED_OUTCOMES: tuple[str, ...] = ("hung_up", "agent_ended", "timeout", "truncated")
USER_SOURCES = ("simulator", "cache", HUMAN_USER_SOURCE)

Finding = tuple[int, str]  # (turn index, note)
Turns = Sequence[TurnRecord]
Signals = Sequence[TurnSignals]


def _reply(turn: TurnRecord) -> str:
    return turn.agent_reply or ""


def _unanswered_doubt(rule: DiagnosisRule, turns: Turns, signals: Signals, outcome: str,
                      schema: StateSchema) -> list[Finding]:
    found = []
    for k in range(1, len(turns)):
        asked = turns[k - 1]
        if asked.user_source not in USER_SOURCES or not asked.user_reply:
            continue
        reply = _reply(turns[k])
        for doubt in rule.doubts:
            if doubt.raised.matches(asked.user_reply) and not doubt.answered.matches(reply):
                found.append((k, doubt.category))
    return found


def _false_claim(rule: DiagnosisRule, turns: Turns, signals: Signals, outcome: str,
                 schema: StateSchema) -> list[Finding]:
    found = []
    done = schema.statuses.completed
    for k, turn in enumerate(turns):
        if turn.agent_status == done and turn.user_status != done:
            found.append((k, f"status {done}, not confirmed"))
        elif rule.cues is not None and rule.cues.matches(_reply(turn)):
            found.append((k, "claimed in words: " + ", ".join(rule.cues.hits(_reply(turn)))))
    return found


def _premature_push(rule: DiagnosisRule, turns: Turns, signals: Signals, outcome: str,
                    schema: StateSchema) -> list[Finding]:
    found = []
    for k, (turn, signal) in enumerate(zip(turns, signals)):
        if not rule.cues.matches(_reply(turn)):
            continue
        state = dict(signal.state_before)
        if signal.state_delta is not None:
            state = {d: state[d] + signal.state_delta[d] for d in schema.names}
        short = [f"{d} {state[d]} {'<' if schema[d].sign > 0 else '>'} {ready}" for d, ready in rule.ready.items()
                 if schema.improvement(d, state[d] - ready) < 0]
        if short:
            found.append((k, "; ".join(short)))
    return found


def _drop_before_hang_up(rule: DiagnosisRule, turns: Turns, signals: Signals, outcome: str,
                         schema: StateSchema) -> list[Finding]:
    if outcome != "hung_up":
        return []
    found = []
    for k in range(max(0, len(turns) - rule.window), len(turns)):
        delta = signals[k].state_delta
        drops = [f"{d} {delta[d]:+d}" for d in rule.dimensions
                 if delta is not None and schema.improvement(d, delta[d]) <= -rule.drop]
        if drops:
            found.append((k, ", ".join(drops)))
    return found


def _format_error(rule: DiagnosisRule, turns: Turns, signals: Signals, outcome: str,
                  schema: StateSchema) -> list[Finding]:
    return [(k, "no usable reply tag or an out-of-range tag") for k, s in enumerate(signals) if s.format_error]


def _loop_to_timeout(rule: DiagnosisRule, turns: Turns, signals: Signals, outcome: str,
                     schema: StateSchema) -> list[Finding]:
    if outcome != "timeout":
        return []
    moved = [k for k, s in enumerate(signals) if s.new_stage or s.state_change > 0]
    after = moved[-1] + 1 if moved else 0
    note = f"no progress after turn {after}" if moved else "no progress in the whole call"
    return [(k, note) for k in range(after, len(turns))]


def _truncated(rule: DiagnosisRule, turns: Turns, signals: Signals, outcome: str,
               schema: StateSchema) -> list[Finding]:
    return [(len(turns) - 1, "token budget ran out")] if outcome == "truncated" and turns else []


_RULES: dict[str, Callable[[DiagnosisRule, Turns, Signals, str, StateSchema], list[Finding]]] = {
    "unanswered_doubt": _unanswered_doubt, "false_claim": _false_claim, "premature_push": _premature_push,
    "drop_before_hang_up": _drop_before_hang_up, "format_error": _format_error,
    "loop_to_timeout": _loop_to_timeout, "truncated": _truncated,
}


def apply_rule(rule: DiagnosisRule, turns: Turns, signals: Signals, outcome: str,
               schema: StateSchema) -> list[Finding]:
    """The (turn index, note) pairs `rule` finds in a dialogue with these turns, signals and outcome (states and
    statuses read with the scenario's `schema`); none unless the outcome is one of DIAGNOSED_OUTCOMES."""
    if outcome not in DIAGNOSED_OUTCOMES:
        return []
    return _RULES[rule.kind](rule, turns, signals, outcome, schema)
