"""Dialogue metrics: the one definition used by training, validation and evaluation.

A *record* is one dialogue as the rollout loop (`llm_agent.generation.LLMGenerationManager`) writes it into
`non_tensor_batch` (see `records_from_batch`): `profile`, `outcome`, `num_turns`, `turns`, `cache_hits`,
`format_errors`, and what it cost (`agent_tokens`, `sim_requests`, `wall_s`). `range_d` is `max - min` of state
dimension d in the scenario's `state_ranges`, so every dimension is normalised by its own range. Records with
outcome `error` (a simulator turn that failed or stayed malformed after its re-requests) count only in
`n_dialogues`, `error_rate`, `completion_rate_all`, `sim_reply_retries` and the cost metrics; every other metric
is over the N non-error records.

A metric whose denominator is empty is *undefined* (ATT when no call completed, FPR when the agent never claimed
success, every rate when all dialogues are errors, ...): `dialogue_metrics` leaves it out of its dict, so
trackers and JSONL files never hold NaN or null, `METRIC_KEYS` lists every key, and displays show `NOT_AVAILABLE`
("n/a"). A value is never NaN and never a 0 that stands for "nothing happened".

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
- `agent_tokens_per_dialogue`, `sim_requests_per_dialogue`, `seconds_per_dialogue` = mean over the records that
  carry it (errors included: they cost too) of `agent_tokens` (tokens the agent generated), `sim_requests`
  (requests sent to a simulator, re-requests included) and `wall_s` (the dialogue's share of its rollout call's
  wall time: the call's seconds / its dialogues, so the shares add up to the time the dialogues took)

A paired turn has all three dimensions present in both its `agent_state` (the agent's estimate) and its
`user_state` (the state the user side reported after that agent turn; for a cached reply the dialogue's own
state carried over, never the cached reply's tags). A simulator value of dimension d counts when the turn's `user_state` holds
a non-None d; the same per-dimension rule applies to the agent's estimates.

Every metric is a ratio of sums over records (or a plain sum): `metric_parts` computes each record's numerator and
denominator once, `MetricParts.values(weights)` aggregates them under any record weights, so a bootstrap
(`llm_agent.evaluation.stats`) resamples by weighting rows instead of re-reading records.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from llm_agent.rollout.outcome import Outcome
from llm_agent.scenario import STATE_DIMS, Scenario

if TYPE_CHECKING:  # records are read from a batch's arrays: the metrics (and the CLIs on them) never need torch
    from verl.protocol import DataProto

__all__ = [
    "COST_FIELDS", "METRIC_KEYS", "MetricParts", "NOT_AVAILABLE", "OUTCOMES", "RECORD_KEYS", "USER_TURN_SOURCES",
    "claimed_done", "dialogue_metrics", "dimension_values", "is_false_positive", "metric_parts", "paired_errors",
    "range_spans", "record_count", "record_field", "record_label", "record_outcome", "record_turns",
    "records_from_batch", "stages_complete", "state_delta", "turn_state_error", "user_turn_count",
]

NOT_AVAILABLE = "n/a"  # how displays show an undefined metric
OUTCOMES: tuple[str, ...] = tuple(outcome.value for outcome in Outcome)
RECORD_KEYS: tuple[str, ...] = ("profile", "outcome", "num_turns", "turns", "cache_hits", "format_errors")
USER_TURN_SOURCES: tuple[str, ...] = ("simulator", "cache")
# record field -> the metric that averages it over the records carrying it (what a dialogue cost)
COST_FIELDS: dict[str, str] = {"agent_tokens": "agent_tokens_per_dialogue", "sim_requests": "sim_requests_per_dialogue",
                               "wall_s": "seconds_per_dialogue"}
_RATE_OF_OUTCOME = {"hung_up": "hang_up_rate", "timeout": "timeout_rate", "truncated": "truncated_rate",
                    "agent_ended": "agent_ended_rate"}
_INDEX_DIMS = {"ei": "emotion", "ti": "trust", "ci": "cooperation"}
METRIC_KEYS: tuple[str, ...] = (
    "n_dialogues", "error_rate", "completion_rate", "completion_rate_all", *_RATE_OF_OUTCOME.values(), "att", "adt", "upa",
    *_INDEX_DIMS, *(f"{k}_agent" for k in _INDEX_DIMS), "stage_completeness", "false_positive_rate",
    "format_error_rate", "cache_hit_rate", "sim_reply_retries", *COST_FIELDS.values(),
)
_TOTALS = ("n_dialogues", "sim_reply_retries")  # plain sums; every other metric is sum(numerator) / sum(denominator)
_COLUMN = {key: i for i, key in enumerate(METRIC_KEYS)}
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


def _cost(record: Mapping[str, Any], field_name: str, where: str) -> float | None:
    """The record's cost field as a float (None when it does not carry it: an older log); ValueError unless it is a
    finite number >= 0."""
    value = record.get(field_name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: {field_name!r} must be a finite number >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class MetricParts:
    """Each record's numerator and denominator of every metric of `METRIC_KEYS` (columns in that order).

    A metric's value over records weighted by w is sum(w * numerator) / sum(w * denominator) (1 minus that for
    `upa`), undefined when the denominator sums to 0; `n_dialogues` and `sim_reply_retries` are sum(w * numerator).
    """

    numerators: np.ndarray  # (n_records, len(METRIC_KEYS)) float64
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
        for key, column in _COLUMN.items():
            out[key] = num[:, column] if key in _TOTALS else ratio[:, column]
        out["upa"] = 1.0 - out["upa"]
        return out

    def point(self) -> dict[str, float]:
        """The defined metrics over all records (each record once), summed with `math.fsum`."""
        num = [math.fsum(col) for col in self.numerators.T]
        den = [math.fsum(col) for col in self.denominators.T]
        out = {}
        for key, column in _COLUMN.items():
            if key in _TOTALS:
                out[key] = num[column]
            elif den[column] > 0:
                out[key] = num[column] / den[column]
        if "upa" in out:
            out["upa"] = 1.0 - out["upa"]
        return out


def _record_parts(record: Mapping[str, Any], index: int, scenario: Scenario, spans: Mapping[str, int]
                  ) -> tuple[np.ndarray, np.ndarray]:
    """The numerator and denominator rows of one record (see `MetricParts`)."""
    where = record_label(record, index)
    num, den = np.zeros(len(METRIC_KEYS)), np.zeros(len(METRIC_KEYS))

    def put(key: str, numerator: float, denominator: float = 1.0) -> None:
        num[_COLUMN[key]], den[_COLUMN[key]] = numerator, denominator

    outcome = record_outcome(record, where)
    error = outcome == "error"
    put("n_dialogues", 1.0)
    put("error_rate", float(error))
    put("completion_rate_all", float(outcome == "completed"))
    if "sim_retries" in record:
        put("sim_reply_retries", float(record_count(record, "sim_retries", where)))
    for field_name, key in COST_FIELDS.items():
        value = _cost(record, field_name, where)
        if value is not None:
            put(key, value)
    if error:
        return num, den
    turns, num_turns = record_turns(record, where), record_count(record, "num_turns", where)
    completed = outcome == "completed"
    put("completion_rate", float(completed))
    for name, key in _RATE_OF_OUTCOME.items():
        put(key, float(outcome == name))
    put("att", float(num_turns) if completed else 0.0, float(completed))
    put("adt", float(num_turns))
    errors = paired_errors(turns, spans)
    put("upa", math.fsum(errors), float(len(errors)))
    profile = record_field(record, "profile", where)
    for key, dim in _INDEX_DIMS.items():
        if not isinstance(profile, Mapping) or profile.get(dim) is None:
            raise ValueError(f"{where}: 'profile' must be a dict holding {dim!r}, got {profile!r}")
        put(key, state_delta([int(profile[dim]), *dimension_values(turns, "user", dim)]))
        put(f"{key}_agent", state_delta(dimension_values(turns, "agent", dim)))
    put("stage_completeness", float(stages_complete(turns, scenario.stage_ids, where)))
    claimed = claimed_done(turns)
    put("false_positive_rate", float(claimed and not completed), float(claimed))
    put("format_error_rate", float(record_count(record, "format_errors", where)), float(num_turns))
    put("cache_hit_rate", float(record_count(record, "cache_hits", where)), float(user_turn_count(turns)))
    return num, den


def metric_parts(records: Sequence[Mapping[str, Any]], scenario: Scenario) -> MetricParts:
    """Every record's numerators and denominators (`MetricParts`); records are checked here, errors name them."""
    spans = range_spans(scenario)
    rows = [_record_parts(record, i, scenario, spans) for i, record in enumerate(records)]
    shape = (len(rows), len(METRIC_KEYS))
    numerators = np.array([r[0] for r in rows]).reshape(shape)
    denominators = np.array([r[1] for r in rows]).reshape(shape)
    return MetricParts(numerators, denominators)


def dialogue_metrics(records: Sequence[Mapping[str, Any]], scenario: Scenario) -> dict[str, float]:
    """Every defined metric of the module docstring over `records`, as {key: float}; an undefined one (empty
    denominator) is left out."""
    return metric_parts(records, scenario).point()
