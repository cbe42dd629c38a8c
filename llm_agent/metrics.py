"""Dialogue metrics: the one definition used by training, validation and evaluation.

A *record* is one dialogue as the rollout loop (`llm_agent.generation.LLMGenerationManager`) writes it into
`non_tensor_batch` (see `records_from_batch`): `profile`, `outcome`, `num_turns`, `turns`, `cache_hits`,
`format_errors`. `range_d` is `max - min` of state dimension d in the scenario's `state_ranges`, so every
dimension is normalised by its own range. Records with outcome `error` (a simulator turn that failed or stayed
malformed after its re-requests) count only in `n_dialogues`, `error_rate`, `completion_rate_all` and
`sim_reply_retries`; every other metric is over the N non-error records. No metric is ever NaN: an empty
denominator gives 0.

- `n_dialogues` = number of records, errors included; `error_rate` = #error / n_dialogues
- `completion_rate` (CR) = #completed / N: error dialogues are NOT in its denominator;
  `completion_rate_all` = #completed / n_dialogues counts them as not completed (equal when error_rate is 0)
- `hang_up_rate`, `timeout_rate`, `truncated_rate`, `agent_ended_rate` = #that outcome / N
- `att` = mean num_turns over completed dialogues; `adt` = mean num_turns over the N dialogues
- `upa` = 1 - mean over paired turns (pooled over dialogues) of mean_d abs(agent_d - user_d) / range_d
- `ei`, `ti`, `ci` = mean over dialogues of (last - first) simulator emotion / trust / cooperation, the profile's
  initial value counting as the first value (raw units)
- `ei_agent`, `ti_agent`, `ci_agent` = the same from the agent's estimates (no profile value; a dialogue with fewer
  than two estimates contributes 0)
- `stage_completeness` = share of dialogues whose reported stages skip none: every SOP stage before the highest
  one reached appears (a dialogue that reports no stage is incomplete)
- `false_positive_rate` (FPR) = FP / (FP + TP): among dialogues where the agent claimed the task done (status 1
  on its last turn: the loop lets the user answer a claim and ends the call after it), the share the user had
  not confirmed (outcome not `completed`)
- `format_error_rate` = sum format_errors / sum num_turns
- `cache_hit_rate` = sum cache_hits / #user turns (turns whose user_source is "simulator" or "cache")
- `sim_reply_retries` = sum over all records of `sim_retries` (re-requests of malformed simulator replies)

A paired turn has all three dimensions present in both its `agent_state` (the agent's estimate) and its
`user_state` (the state the user side reported after that agent turn; for a cached reply the dialogue's own
state carried over, never the cached reply's tags). A simulator value of dimension d counts when the turn's `user_state` holds
a non-None d; the same per-dimension rule applies to the agent's estimates.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from llm_agent.rollout.outcome import Outcome
from llm_agent.scenario import STATE_DIMS, Scenario

if TYPE_CHECKING:  # records are read from a batch's arrays: the metrics (and the CLIs on them) never need torch
    from verl.protocol import DataProto

__all__ = [
    "METRIC_KEYS", "OUTCOMES", "RECORD_KEYS", "USER_TURN_SOURCES", "claimed_done", "dialogue_metrics",
    "dimension_values", "is_false_positive", "paired_errors", "range_spans", "record_count", "record_field",
    "record_label", "record_outcome", "record_turns", "records_from_batch", "stages_complete", "state_delta",
    "turn_state_error", "user_turn_count",
]

OUTCOMES: tuple[str, ...] = tuple(outcome.value for outcome in Outcome)
RECORD_KEYS: tuple[str, ...] = ("profile", "outcome", "num_turns", "turns", "cache_hits", "format_errors")
USER_TURN_SOURCES: tuple[str, ...] = ("simulator", "cache")
_RATE_OF_OUTCOME = {"hung_up": "hang_up_rate", "timeout": "timeout_rate", "truncated": "truncated_rate",
                    "agent_ended": "agent_ended_rate"}
_INDEX_DIMS = {"ei": "emotion", "ti": "trust", "ci": "cooperation"}
METRIC_KEYS: tuple[str, ...] = (
    "n_dialogues", "error_rate", "completion_rate", "completion_rate_all", *_RATE_OF_OUTCOME.values(), "att", "adt", "upa",
    *_INDEX_DIMS, *(f"{k}_agent" for k in _INDEX_DIMS), "stage_completeness", "false_positive_rate",
    "format_error_rate", "cache_hit_rate", "sim_reply_retries",
)
_LOOP = "llm_agent.generation.LLMGenerationManager"


def records_from_batch(data: DataProto, required: Sequence[str] = RECORD_KEYS) -> list[dict[str, Any]]:
    """Turn each row of `data.non_tensor_batch` into a record dict holding every non-tensor key of that row.

    Numpy scalars become Python scalars. A key of `required` missing from the batch raises KeyError naming it and
    saying the rollout loop must be `llm_agent.generation.LLMGenerationManager` (the only writer of these keys).
    """
    columns = data.non_tensor_batch
    for key in required:
        if key not in columns:
            raise KeyError(f"non_tensor_batch has no {key!r} column (got {sorted(columns)}); dialogue rewards and "
                           f"metrics need the per-dialogue records written by the rollout loop, so set "
                           f"rollout_loop.path={_LOOP}")
    return [{key: _python(values[i]) for key, values in columns.items()} for i in range(len(data))]


def _python(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def range_spans(scenario: Scenario) -> dict[str, int]:
    """{dimension: max - min} of the scenario's state ranges; ValueError when a range is a single value."""
    spans = {d: scenario.state_ranges[d].max - scenario.state_ranges[d].min for d in STATE_DIMS}
    for dim, span in spans.items():
        if span <= 0:
            raise ValueError(f"scenario {scenario.name!r}: state_ranges.{dim} has max == min, so the dimension "
                             f"cannot be normalised")
    return spans


def record_field(record: Mapping[str, Any], key: str, where: str) -> Any:
    """record[key]; KeyError naming `where` and the key when it is missing."""
    if key not in record:
        raise KeyError(f"{where}: the record has no {key!r} (keys: {sorted(record)})")
    return record[key]


def record_count(record: Mapping[str, Any], key: str, where: str) -> int:
    """record[key] as an int; ValueError naming `where` and the key unless it is a non-negative int."""
    value = record_field(record, key, where)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{where}: {key!r} must be a non-negative int, got {value!r}")
    return int(value)


def record_outcome(record: Mapping[str, Any], where: str) -> str:
    """record["outcome"]; ValueError naming `where` unless it is one of OUTCOMES."""
    value = record_field(record, "outcome", where)
    if value not in OUTCOMES:
        raise ValueError(f"{where}: outcome {value!r} is not one of {list(OUTCOMES)}")
    return value


def record_turns(record: Mapping[str, Any], where: str) -> list[Mapping[str, Any]]:
    """record["turns"] as a list; ValueError naming `where` unless it is a list of turn dicts."""
    value = record_field(record, "turns", where)
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, Mapping) for t in value):
        raise ValueError(f"{where}: 'turns' must be a list of turn dicts, got {type(value).__name__}")
    return list(value)


def record_label(record: Mapping[str, Any], index: int) -> str:
    """How error messages name a record: its index and dialogue_id."""
    return f"record {index} (dialogue_id {record.get('dialogue_id')!r})"


def dimension_values(turns: Sequence[Mapping[str, Any]], side: str, dim: str) -> list[int]:
    """The non-None values of dimension `dim` in each turn's `<side>_state` ("user" or "agent"), in turn order."""
    key = f"{side}_state"
    out = []
    for turn in turns:
        state = turn.get(key)
        if isinstance(state, Mapping) and state.get(dim) is not None:
            out.append(int(state[dim]))
    return out


def state_delta(values: Sequence[int]) -> float:
    """last - first of `values`, 0.0 when there are fewer than two."""
    return float(values[-1] - values[0]) if len(values) >= 2 else 0.0


def turn_state_error(agent_state: Any, user_state: Any, spans: Mapping[str, int]) -> float | None:
    """mean_d |agent_d - user_d| / span_d when both states hold every dimension, else None (not a paired turn)."""
    if not isinstance(agent_state, Mapping) or not isinstance(user_state, Mapping):
        return None
    if any(agent_state.get(d) is None or user_state.get(d) is None for d in STATE_DIMS):
        return None
    return sum(abs(agent_state[d] - user_state[d]) / spans[d] for d in STATE_DIMS) / len(STATE_DIMS)


def paired_errors(turns: Sequence[Mapping[str, Any]], spans: Mapping[str, int]) -> list[float]:
    """`turn_state_error` of every paired turn of a dialogue, in turn order."""
    errors = (turn_state_error(t.get("agent_state"), t.get("user_state"), spans) for t in turns)
    return [e for e in errors if e is not None]


def claimed_done(turns: Sequence[Mapping[str, Any]]) -> bool:
    """True when the agent's status on its last turn is 1 (it declared the task done)."""
    return bool(turns) and turns[-1].get("agent_status") == 1


def is_false_positive(outcome: str, turns: Sequence[Mapping[str, Any]]) -> bool:
    """The agent claimed done on its last turn but the dialogue did not complete."""
    return claimed_done(turns) and outcome != "completed"


def user_turn_count(turns: Sequence[Mapping[str, Any]]) -> int:
    """Turns answered by the user side (a simulator reply or a cached one; format-error notes do not count)."""
    return sum(1 for t in turns if t.get("user_source") in USER_TURN_SOURCES)


def stages_complete(turns: Sequence[Mapping[str, Any]], stage_ids: Sequence[int], where: str = "dialogue") -> bool:
    """True when the agent reported a stage and every SOP stage before the highest one it reached appears."""
    order = {sid: i for i, sid in enumerate(stage_ids)}
    seen = set()
    for turn in turns:
        stage = turn.get("agent_stage")
        if stage is None:
            continue
        if stage not in order:
            raise ValueError(f"{where}: agent_stage {stage!r} is not a stage id of the scenario {list(stage_ids)}")
        seen.add(order[stage])
    return bool(seen) and seen == set(range(max(seen) + 1))


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else 0.0


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def dialogue_metrics(records: Sequence[Mapping[str, Any]], scenario: Scenario) -> dict[str, float]:
    """Every metric of the module docstring over `records`, as {key: float}; see the table there."""
    spans = range_spans(scenario)
    scored: list[tuple[Mapping[str, Any], str, list[Mapping[str, Any]], int, str]] = []
    n_error = 0
    for i, record in enumerate(records):
        where = record_label(record, i)
        outcome = record_outcome(record, where)
        if outcome == "error":
            n_error += 1
            continue
        turns, num_turns = record_turns(record, where), record_count(record, "num_turns", where)
        scored.append((record, outcome, turns, num_turns, where))
    n = len(scored)
    outcomes = [s[1] for s in scored]
    turn_counts = [s[3] for s in scored]
    metrics: dict[str, float] = {
        "n_dialogues": float(len(records)),
        "error_rate": _ratio(n_error, len(records)),
        "completion_rate": _ratio(outcomes.count("completed"), n),
        "completion_rate_all": _ratio(outcomes.count("completed"), len(records)),
        **{key: _ratio(outcomes.count(outcome), n) for outcome, key in _RATE_OF_OUTCOME.items()},
        "att": _mean([t for t, o in zip(turn_counts, outcomes) if o == "completed"]),
        "adt": _mean(turn_counts),
    }
    errors = [e for _, _, turns, _, _ in scored for e in paired_errors(turns, spans)]
    metrics["upa"] = 1.0 - _mean(errors) if errors else 0.0
    for key, dim in _INDEX_DIMS.items():
        sim, agent = [], []
        for record, _, turns, _, where in scored:
            profile = record_field(record, "profile", where)
            if not isinstance(profile, Mapping) or profile.get(dim) is None:
                raise ValueError(f"{where}: 'profile' must be a dict holding {dim!r}, got {profile!r}")
            sim.append(state_delta([int(profile[dim]), *dimension_values(turns, "user", dim)]))
            agent.append(state_delta(dimension_values(turns, "agent", dim)))
        metrics[key], metrics[f"{key}_agent"] = _mean(sim), _mean(agent)
    metrics["stage_completeness"] = _ratio(
        sum(stages_complete(turns, scenario.stage_ids, where) for _, _, turns, _, where in scored), n)
    claims = [(o, turns) for _, o, turns, _, _ in scored if claimed_done(turns)]
    metrics["false_positive_rate"] = _ratio(sum(o != "completed" for o, _ in claims), len(claims))
    metrics["format_error_rate"] = _ratio(sum(record_count(r, "format_errors", w) for r, *_, w in scored),
                                          sum(turn_counts))
    metrics["cache_hit_rate"] = _ratio(sum(record_count(r, "cache_hits", w) for r, *_, w in scored),
                                       sum(user_turn_count(turns) for _, _, turns, _, _ in scored))
    metrics["sim_reply_retries"] = float(sum(record_count(r, "sim_retries", record_label(r, i))
                                             for i, r in enumerate(records) if "sim_retries" in r))
    return metrics
