"""Dialogue metrics: the one definition used by training, validation and evaluation.

A *record* is one dialogue, a `DialogueRecord` as the rollout loop (`llm_agent.generation.LLMGenerationManager`)
makes it (or as a log line reads back: `DialogueRecord.from_dict`): `profile`, `outcome`, `turns`, `cache_hits`,
`format_errors`, and what it cost (`agent_tokens`, `sim_requests`, `wall_s`). The state dimensions d are the
scenario's (`Scenario.state_schema`); `range_d` is `max - min` of d, so every dimension is normalised by its own
range, and `sign_d` is +1 where higher values are better for the user, -1 where lower ones are. Records with
outcome `error` (a simulator turn that failed or stayed malformed after its re-requests) count only in
`n_dialogues`, `error_rate`, `completion_rate_all`, `sim_reply_retries` and the cost metrics; every other metric
is over the N non-error records.

A metric whose denominator is empty is *undefined* (ATT when no call completed, FPR when the agent never claimed
success, every rate when all dialogues are errors, ...): `dialogue_metrics` leaves it out of its dict, so
trackers and JSONL files never hold NaN or null, `metric_keys(scenario)` lists every key, and displays show
`NOT_AVAILABLE`
("n/a"). A value is never NaN and never a 0 that stands for "nothing happened".

- `n_dialogues` = number of records, errors included; `error_rate` = #error / n_dialogues
- `completion_rate` (CR) = #completed / N: error dialogues are NOT in its denominator;
  `completion_rate_all` = #completed / n_dialogues counts them as not completed (equal when error_rate is 0)
- `hang_up_rate`, `timeout_rate`, `truncated_rate`, `agent_ended_rate` = #that outcome / N
- `att` = mean num_turns over completed dialogues; `adt` = mean num_turns over the N dialogues
- `upa` = 1 - mean over paired turns (pooled over dialogues) of mean_d abs(agent_d - user_d) / range_d
- `<short>i` per dimension (the improvement index: `ci`, `ei`, `ti` for the shipped scenarios' cooperation,
  emotion and trust) = mean over dialogues of sign_d * (last - first) simulator value of d, the profile's initial
  value counting as the first value (raw units; positive: the user ended better off)
- `<short>i_agent` = the same from the agent's estimates (no profile value; a dialogue with fewer than two
  estimates contributes 0)
- `stage_completeness` = share of dialogues whose reported stages skip none: every SOP stage before the highest
  one reached appears (a dialogue that reports no stage is incomplete)
- `false_positive_rate` (FPR) = FP / (FP + TP): among dialogues where the agent claimed the task done (status
  `completed` on its last turn: the loop lets the user answer a claim and ends the call after it), the share the user
  had
  not confirmed (outcome not `completed`)
- `format_error_rate` = sum format_errors / sum num_turns
- `cache_hit_rate` = sum cache_hits / #user turns (turns whose user_source is "simulator", "cache" or "human")
- `sim_reply_retries` = sum over all records of `sim_retries` (re-requests of malformed simulator replies)
- `agent_tokens_per_dialogue`, `sim_requests_per_dialogue`, `seconds_per_dialogue` = mean over the records that
  carry it (errors included: they cost too) of `agent_tokens` (tokens the agent generated), `sim_requests`
  (requests sent to a simulator, re-requests included) and `wall_s` (the dialogue's share of its rollout call's
  wall time: the call's seconds / its dialogues, so the shares add up to the time the dialogues took)

A paired turn has every dimension present in both its `agent_state` (the agent's estimate) and its
`user_state` (the state the user side reported after that agent turn; for a cached reply the dialogue's own
state carried over, never the cached reply's tags). A simulator value of dimension d counts when the turn's `user_state`
holds
a non-None d; the same per-dimension rule applies to the agent's estimates.

Every metric is a ratio of sums over records (or a plain sum): `metric_parts` computes each record's numerator and
denominator once, `MetricParts.values(weights)` aggregates them under any record weights, so a bootstrap
(`llm_agent.evaluation.stats`) resamples by weighting rows instead of re-reading records.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from llm_agent.rollout.dialogue_record import (HUMAN_USER_SOURCE, OUTCOMES, DialogueRecord, TurnRecord,
                                               records_from_batch)
from llm_agent.scenario import Scenario

__all__ = [
    "COST_FIELDS", "MetricParts", "NOT_AVAILABLE", "OUTCOMES", "USER_TURN_SOURCES", "claimed_done",
    "dialogue_metrics", "dimension_values", "index_keys", "is_false_positive", "metric_keys", "metric_parts",
    "paired_errors", "record_label", "records_from_batch", "stages_complete", "state_delta", "turn_state_error",
    "user_turn_count",
]

NOT_AVAILABLE = "n/a"  # how displays show an undefined metric
USER_TURN_SOURCES: tuple[str, ...] = ("simulator", "cache", HUMAN_USER_SOURCE)
# record field -> the metric that averages it over the records carrying it (what a dialogue cost)
COST_FIELDS: dict[str, str] = {"agent_tokens": "agent_tokens_per_dialogue", "sim_requests": "sim_requests_per_dialogue",
                               "wall_s": "seconds_per_dialogue"}
_RATE_OF_OUTCOME = {"hung_up": "hang_up_rate", "timeout": "timeout_rate", "truncated": "truncated_rate",
                    "agent_ended": "agent_ended_rate"}
_HEAD_KEYS = ("n_dialogues", "error_rate", "completion_rate", "completion_rate_all", *_RATE_OF_OUTCOME.values(), "att",
              "adt", "upa")
_TAIL_KEYS = ("stage_completeness", "false_positive_rate", "format_error_rate", "cache_hit_rate", "sim_reply_retries",
              *COST_FIELDS.values())
_TOTALS = ("n_dialogues", "sim_reply_retries")  # plain sums; every other metric is sum(numerator) / sum(denominator)


def index_keys(scenario: Scenario) -> dict[str, str]:
    """{improvement metric key: its dimension}, in the scenario's dimension order (ci, ei, ti for the shipped
    scenarios)."""
    return {f"{d.short}i": d.name for d in scenario.state_schema.dimensions}


def metric_keys(scenario: Scenario) -> tuple[str, ...]:
    """Every metric key `dialogue_metrics` can give for `scenario`'s records, in display order."""
    indices = tuple(index_keys(scenario))
    return (*_HEAD_KEYS, *indices, *(f"{k}_agent" for k in indices), *_TAIL_KEYS)


def record_label(record: DialogueRecord, index: int) -> str:
    """How error messages name a record: its index and dialogue_id."""
    return f"record {index} (dialogue_id {record.dialogue_id!r})"


def dimension_values(turns: Sequence[TurnRecord], side: str, dim: str) -> list[int]:
    """The non-None values of dimension `dim` in each turn's `<side>_state` ("user" or "agent"), in turn order."""
    out = []
    for turn in turns:
        state = turn.user_state if side == "user" else turn.agent_state
        if state is not None and state.get(dim) is not None:
            out.append(int(state[dim]))
    return out


def state_delta(values: Sequence[int]) -> float:
    """last - first of `values`, 0.0 when there are fewer than two."""
    return float(values[-1] - values[0]) if len(values) >= 2 else 0.0


def turn_state_error(agent_state: dict | None, user_state: dict | None, spans: dict[str, int]) -> float | None:
    """mean_d abs(agent_d - user_d) / span_d when both states hold every dimension of `spans`, else None (not a
    paired turn)."""
    if agent_state is None or user_state is None:
        return None
    if any(agent_state.get(d) is None or user_state.get(d) is None for d in spans):
        return None
    return sum(abs(agent_state[d] - user_state[d]) / spans[d] for d in spans) / len(spans)


def paired_errors(turns: Sequence[TurnRecord], spans: dict[str, int]) -> list[float]:
    """`turn_state_error` of every paired turn of a dialogue, in turn order."""
    errors = (turn_state_error(t.agent_state, t.user_state, spans) for t in turns)
    return [e for e in errors if e is not None]


def claimed_done(turns: Sequence[TurnRecord], completed: int) -> bool:
    """True when the agent's status on its last turn is `completed` (it declared the task done)."""
    return bool(turns) and turns[-1].agent_status == completed


def is_false_positive(outcome: str, turns: Sequence[TurnRecord], completed: int) -> bool:
    """The agent claimed done on its last turn but the dialogue did not complete."""
    return claimed_done(turns, completed) and outcome != "completed"


def user_turn_count(turns: Sequence[TurnRecord]) -> int:
    """Turns answered by the user side (a simulator, cached or person's reply; format-error notes do not count)."""
    return sum(1 for t in turns if t.user_source in USER_TURN_SOURCES)


def stages_complete(turns: Sequence[TurnRecord], stage_ids: Sequence[int], where: str = "dialogue") -> bool:
    """True when the agent reported a stage and every SOP stage before the highest one it reached appears."""
    order = {sid: i for i, sid in enumerate(stage_ids)}
    seen = set()
    for turn in turns:
        stage = turn.agent_stage
        if stage is None:
            continue
        if stage not in order:
            raise ValueError(f"{where}: agent_stage {stage!r} is not a stage id of the scenario {list(stage_ids)}")
        seen.add(order[stage])
    return bool(seen) and seen == set(range(max(seen) + 1))


@dataclass(frozen=True)
class MetricParts:
    """Each record's numerator and denominator of every metric of `keys` (columns in that order).

    A metric's value over records weighted by w is sum(w * numerator) / sum(w * denominator) (1 minus that for
    `upa`), undefined when the denominator sums to 0; `n_dialogues` and `sim_reply_retries` are sum(w * numerator).
    """

    keys: tuple[str, ...]
    numerators: np.ndarray  # (n_records, len(keys)) float64
    denominators: np.ndarray  # same shape

    def __len__(self) -> int:
        return self.numerators.shape[0]

    def values(self, weights: np.ndarray) -> dict[str, np.ndarray]:
        """{key: one value per row of `weights` (R, n_records)}, NaN where the metric is undefined."""
        weights = np.asarray(weights, dtype=np.float64)
        num, den = weights @ self.numerators, weights @ self.denominators
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)
        out = {}
        for column, key in enumerate(self.keys):
            out[key] = num[:, column] if key in _TOTALS else ratio[:, column]
        out["upa"] = 1.0 - out["upa"]
        return out

    def point(self) -> dict[str, float]:
        """The defined metrics over all records (each record once), summed with `math.fsum`."""
        num = [math.fsum(col) for col in self.numerators.T]
        den = [math.fsum(col) for col in self.denominators.T]
        out = {}
        for column, key in enumerate(self.keys):
            if key in _TOTALS:
                out[key] = num[column]
            elif den[column] > 0:
                out[key] = num[column] / den[column]
        if "upa" in out:
            out["upa"] = 1.0 - out["upa"]
        return out


def _record_parts(record: DialogueRecord, index: int, scenario: Scenario, columns: dict[str, int]
                  ) -> tuple[np.ndarray, np.ndarray]:
    """The numerator and denominator rows of one record (see `MetricParts`)."""
    where = record_label(record, index)
    num, den = np.zeros(len(columns)), np.zeros(len(columns))

    def put(key: str, numerator: float, denominator: float = 1.0) -> None:
        num[columns[key]], den[columns[key]] = numerator, denominator

    outcome = record.outcome
    error = outcome == "error"
    put("n_dialogues", 1.0)
    put("error_rate", float(error))
    put("completion_rate_all", float(outcome == "completed"))
    put("sim_reply_retries", float(record.sim_retries))
    for key, value in zip(COST_FIELDS.values(), (record.agent_tokens, record.sim_requests, record.wall_s)):
        if value is not None:
            put(key, float(value))
    if error:
        return num, den
    turns, num_turns = record.turns, record.num_turns
    completed = outcome == "completed"
    put("completion_rate", float(completed))
    for name, key in _RATE_OF_OUTCOME.items():
        put(key, float(outcome == name))
    put("att", float(num_turns) if completed else 0.0, float(completed))
    put("adt", float(num_turns))
    schema = scenario.state_schema
    errors = paired_errors(turns, schema.spans)
    put("upa", math.fsum(errors), float(len(errors)))
    initial = record.initial_state(schema.names, where)
    for key, dim in index_keys(scenario).items():
        sign = schema[dim].sign
        put(key, sign * state_delta([initial[dim], *dimension_values(turns, "user", dim)]))
        put(f"{key}_agent", sign * state_delta(dimension_values(turns, "agent", dim)))
    put("stage_completeness", float(stages_complete(turns, scenario.stage_ids, where)))
    claimed = claimed_done(turns, scenario.statuses.completed)
    put("false_positive_rate", float(claimed and not completed), float(claimed))
    put("format_error_rate", float(record.format_errors), float(num_turns))
    put("cache_hit_rate", float(record.cache_hits), float(user_turn_count(turns)))
    return num, den


def metric_parts(records: Sequence[DialogueRecord], scenario: Scenario) -> MetricParts:
    """Every record's numerators and denominators (`MetricParts`); records are checked here, errors name them."""
    keys = metric_keys(scenario)
    columns = {key: i for i, key in enumerate(keys)}
    rows = [_record_parts(record, i, scenario, columns) for i, record in enumerate(records)]
    shape = (len(rows), len(keys))
    numerators = np.array([r[0] for r in rows]).reshape(shape)
    denominators = np.array([r[1] for r in rows]).reshape(shape)
    return MetricParts(keys, numerators, denominators)


def dialogue_metrics(records: Sequence[DialogueRecord], scenario: Scenario) -> dict[str, float]:
    """Every defined metric of the module docstring over `records`, as {key: float}; an undefined one (empty
    denominator) is left out."""
    return metric_parts(records, scenario).point()
