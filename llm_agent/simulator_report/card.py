"""The simulator report card: every metric of a set of graded simulator turns, with bootstrap intervals.

Each turn is checked (`checks.py`) against the scripted persona's reaction to the same request
(`reference.py`). Per-turn rates are over all graded turns; a turn with no accepted reply counts as failing
every check of its reply:

- `first_try_valid_rate`: the first reply is format-valid (strict tag protocol); `first_try_accepted_rate`: the
  rollout loop takes the first reply as it is (no re-request);
- `rerequest_rate`: turns that needed at least one re-request; `rerequests_per_turn`: re-requests per turn (for
  logged dialogues, their `sim_retries` per graded turn); `failed_rate`: no acceptable reply after every
  request, or no answer at all;
- `control_text_rate`: some reply of the turn holds control-token text (`<|im_start|>`, `</s>`, ...: an attempt to
  end its message and open another; such a reply is never format-valid);
- `format_valid_rate`: the reply the loop would use is format-valid; `jump_within_limits_rate`,
  `direction_consistent_rate`: its state moved within the scenario's limits / never against the agent's turn;
- `scripted_direction_agreement`, `scripted_state_agreement`, `scripted_status_agreement`: the same direction
  of change on all three dimensions / the same new state / the same status as the scripted persona;
- `behaviour_adherence`: over (dialogue, behaviour) pairs whose doubt the scripted persona voices in that
  dialogue, the share the simulator voiced in some turn of it;
- `latency_p50_s`, `latency_p95_s`: per request (live runs only);
- `distinct_1`, `distinct_2`, `unique_reply_rate`: distinct words / word pairs per word of the accepted spoken
  replies, distinct replies per reply (no interval: a resample repeats dialogues).

`by_agent` repeats the agreement metrics (`AGENT_KEYS`) per quality of the scripted agent that spoke in the probe
dialogues (`wrong_answer`: doubts answered with another category's answer, which a simulator that can be exploited
takes for an answer); empty for logged dialogues.

Intervals: percentile bootstrap over dialogues (`llm_agent.evaluation.stats.bootstrap_intervals`), since turns
of one dialogue share a persona and a history. A metric that cannot be measured (e.g. first-try checks of
logged turns, latency of logs) is None.
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from llm_agent.evaluation.stats import DEFAULT_CONFIDENCE, DEFAULT_RESAMPLES, Interval, bootstrap_intervals
from llm_agent.scenario import Scenario
from llm_agent.simulator_report.checks import ReplyCheck, ReplyChecker
from llm_agent.simulator_report.reference import Reference, ScriptedReference
from llm_agent.simulator_report.turns import SimDialogue

__all__ = ["AGENT_KEYS", "DIVERSITY_KEYS", "INTERVAL_KEYS", "METRIC_KEYS", "ScoredDialogue", "ScoredTurn",
           "build_card", "card_metrics", "score_dialogues"]

INTERVAL_KEYS = ("first_try_valid_rate", "first_try_accepted_rate", "rerequest_rate", "rerequests_per_turn",
                 "failed_rate", "control_text_rate", "format_valid_rate", "jump_within_limits_rate",
                 "direction_consistent_rate",
                 "scripted_direction_agreement", "scripted_state_agreement", "scripted_status_agreement",
                 "behaviour_adherence", "latency_p50_s", "latency_p95_s")
DIVERSITY_KEYS = ("distinct_1", "distinct_2", "unique_reply_rate")
METRIC_KEYS = INTERVAL_KEYS + DIVERSITY_KEYS
AGENT_KEYS = ("format_valid_rate", "scripted_direction_agreement", "scripted_state_agreement",
              "scripted_status_agreement")
_CHECK_RATES = {"format_valid_rate": "format_valid", "jump_within_limits_rate": "jump_ok",
                "direction_consistent_rate": "direction_ok", "scripted_direction_agreement": "agrees_direction",
                "scripted_state_agreement": "agrees_state", "scripted_status_agreement": "agrees_status"}
_WORD_RE = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")
MAX_EXAMPLES = 5


@dataclass(frozen=True)
class ScoredTurn:
    """One graded turn: the scripted reference, the check of the accepted reply (None: no acceptable reply),
    whether the first reply was format-valid / accepted (None: unknown), the requests made and their latencies,
    and the first reply holding control-token text (None: none did)."""

    reference: Reference
    check: ReplyCheck | None
    first_valid: bool | None
    first_accepted: bool | None
    requests: int | None
    latencies_s: tuple[float, ...]
    first_reply: str | None
    control_reply: str | None = None


@dataclass(frozen=True)
class ScoredDialogue:
    """The graded turns of one dialogue, the behaviour categories the reference voices in it (limited to the
    profile's own), and a logged dialogue's re-request count."""

    dialogue_id: str
    turns: tuple[ScoredTurn, ...]
    expected_doubts: frozenset[str]
    logged_rerequests: int | None
    agent: str | None = None


def score_dialogues(dialogues: Sequence[SimDialogue], scenario: Scenario, max_jump: int | None = None
                    ) -> list[ScoredDialogue]:
    """Check every turn of `dialogues` against the scripted persona's reaction to the same request."""
    reference, checker = ScriptedReference(scenario), ReplyChecker(scenario, max_jump)
    scored = []
    for dialogue in dialogues:
        turns = []
        for turn in dialogue.turns:
            ref = reference.react(turn.messages)
            checks = [checker.check(text, ref) for text in turn.replies]
            accepted = next((c for c in checks if c.accepted), None)
            known = turn.first_try_known
            turns.append(ScoredTurn(
                reference=ref, check=accepted,
                first_valid=(bool(checks) and checks[0].format_valid) if known else None,
                first_accepted=(bool(checks) and checks[0].accepted) if known else None,
                requests=len(turn.replies) + (turn.failure is not None) if known else None,
                latencies_s=tuple(turn.latencies_s), first_reply=turn.replies[0] if turn.replies else None,
                control_reply=next((text for text, c in zip(turn.replies, checks) if c.control_text), None)))
        own = {b.category for b in dialogue.profile.behaviors}
        expected = frozenset(t.reference.doubt for t in turns if t.reference.doubt in own)
        scored.append(ScoredDialogue(dialogue.dialogue_id, tuple(turns), expected, dialogue.logged_rerequests,
                                     dialogue.agent))
    return scored


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return float(np.mean(values)) if values else None


def _distinct(replies: Sequence[str], n: int) -> float | None:
    grams = [tuple(words[i:i + n]) for words in (_WORD_RE.findall(r.lower()) for r in replies)
             for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if grams else None


def card_metrics(dialogues: Sequence[ScoredDialogue], diversity: bool = True) -> dict[str, float | None]:
    """Every metric of the module docstring over `dialogues` (`diversity=False` leaves those three out)."""
    turns = [t for d in dialogues for t in d.turns]
    out: dict[str, float | None] = {}
    out["first_try_valid_rate"] = _mean(t.first_valid for t in turns if t.first_valid is not None)
    out["first_try_accepted_rate"] = _mean(t.first_accepted for t in turns if t.first_accepted is not None)
    live = [t for t in turns if t.requests is not None]
    out["rerequest_rate"] = _mean(t.requests > 1 for t in live)
    logged = [d for d in dialogues if d.logged_rerequests is not None]
    if live:
        out["rerequests_per_turn"] = _mean(t.requests - 1 for t in live)
    else:
        graded = sum(len(d.turns) for d in logged)
        out["rerequests_per_turn"] = sum(d.logged_rerequests for d in logged) / graded if graded else None
    out["failed_rate"] = _mean(t.check is None for t in turns)
    out["control_text_rate"] = _mean(t.control_reply is not None for t in turns)
    for key, attribute in _CHECK_RATES.items():
        out[key] = _mean(t.check is not None and getattr(t.check, attribute) for t in turns)
    expected = sum(len(d.expected_doubts) for d in dialogues)
    voiced = sum(len(d.expected_doubts & frozenset().union(*(t.check.voiced for t in d.turns if t.check)))
                 for d in dialogues)
    out["behaviour_adherence"] = voiced / expected if expected else None
    latencies = [s for t in turns for s in t.latencies_s]
    out["latency_p50_s"] = float(np.quantile(latencies, 0.5)) if latencies else None
    out["latency_p95_s"] = float(np.quantile(latencies, 0.95)) if latencies else None
    if diversity:
        replies = [t.check.user.reply or "" for t in turns if t.check is not None]
        out["distinct_1"], out["distinct_2"] = _distinct(replies, 1), _distinct(replies, 2)
        out["unique_reply_rate"] = len(set(replies)) / len(replies) if replies else None
    return out


def _metrics(dialogues: Sequence[ScoredDialogue], n_resamples: int, confidence: float, seed: int
             ) -> dict[str, Any]:
    """`card_metrics` of `dialogues`, with bootstrap intervals when `n_resamples` > 0."""
    if n_resamples <= 0:
        return card_metrics(dialogues)
    metrics = bootstrap_intervals(dialogues, lambda rows: card_metrics(rows, diversity=False), n_resamples,
                                  confidence, seed)
    metrics.update({k: v for k, v in card_metrics(dialogues).items() if k in DIVERSITY_KEYS})
    return metrics


def _by_agent(dialogues: Sequence[ScoredDialogue], n_resamples: int, confidence: float, seed: int
              ) -> dict[str, dict[str, Any]]:
    """Per probing agent quality: its dialogue and turn counts and the `AGENT_KEYS` metrics."""
    out = {}
    for agent in sorted({d.agent for d in dialogues if d.agent is not None}):
        rows = [d for d in dialogues if d.agent == agent and d.turns]
        if rows:
            metrics = _metrics(rows, n_resamples, confidence, seed)
            out[agent] = {"n_dialogues": len(rows), "n_turns": sum(len(d.turns) for d in rows),
                          **{key: _interval_json(metrics.get(key)) for key in AGENT_KEYS}}
    return out


def _interval_json(value: Interval | float | None) -> Any:
    return value.to_dict() if isinstance(value, Interval) else value


def _examples(dialogues: Sequence[ScoredDialogue]) -> dict[str, list[dict[str, Any]]]:
    """A few first replies that were not format-valid, a few holding control-token text and a few accepted ones
    whose direction disagreed."""
    malformed, control, disagreeing = [], [], []
    for d in dialogues:
        for i, t in enumerate(d.turns):
            where = {"dialogue_id": d.dialogue_id, "turn": i}
            if t.control_reply is not None and len(control) < MAX_EXAMPLES:
                control.append({**where, "reply": t.control_reply[:400]})
            if t.first_valid is False and len(malformed) < MAX_EXAMPLES:
                malformed.append({**where, "reply": (t.first_reply or "")[:400]})
            if t.check is not None and not t.check.agrees_direction and len(disagreeing) < MAX_EXAMPLES:
                disagreeing.append({**where, "reply": t.check.user.raw[:400], "scripted_state": t.reference.state,
                                    "previous_state": t.reference.previous, "events": list(t.reference.events)})
    return {"malformed_first_replies": malformed, "control_text_replies": control,
            "direction_disagreements": disagreeing}


def probe_fingerprint(messages: Iterable[Sequence[Mapping[str, str]]]) -> str:
    """sha256 of the requests' messages: two cards graded the same requests when their fingerprints match."""
    digest = hashlib.sha256()
    for request in messages:
        digest.update(json.dumps(list(request), sort_keys=True, ensure_ascii=False).encode())
    return digest.hexdigest()


def build_card(dialogues: Sequence[SimDialogue], scenario: Scenario, name: str, source: Mapping[str, Any],
               n_resamples: int = DEFAULT_RESAMPLES, confidence: float = DEFAULT_CONFIDENCE, seed: int = 0,
               max_jump: int | None = None, human: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The report card of `dialogues` as a JSON-ready dict: `name`, `source` (what was measured and how), counts,
    `metrics` ({value, low, high, resamples} with intervals when `n_resamples` > 0, else plain values; None when
    not measurable), `by_agent` (the module docstring), the jump limits used, a few failing examples and, when
    given, the `human` section (`llm_agent.simulator_report.human.human_section`)."""
    graded = any(d.turns for d in dialogues)
    if not graded and human is None:
        raise ValueError(f"simulator report {name!r}: no simulator turns to grade")
    scored = score_dialogues(dialogues, scenario, max_jump)
    metrics = _metrics(scored, n_resamples if graded else 0, confidence, seed)
    checker = ReplyChecker(scenario, max_jump)
    return {"name": name, "scenario": scenario.name, "source": dict(source),
            "n_dialogues": len(scored), "n_turns": sum(len(d.turns) for d in scored),
            "probe_fingerprint": probe_fingerprint(t.messages for d in dialogues for t in d.turns),
            "metrics": {key: _interval_json(metrics.get(key)) for key in METRIC_KEYS},
            "by_agent": _by_agent(scored, n_resamples, confidence, seed),
            "bootstrap": {"n_resamples": n_resamples, "confidence": confidence, "seed": seed},
            "jump_limits": {d: {"fall": lo, "rise": hi} for d, (lo, hi) in checker.limits.items()},
            "examples": _examples(scored), **({"human": dict(human)} if human is not None else {})}
