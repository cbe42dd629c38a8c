"""Dialogue rewards: the trainer's `reward.path=llm_agent.reward.compute_reward` plug-in.

Each row's reward comes from that row's own `DialogueRecord` (the rollout loop's, in `non_tensor_batch`, never from
`meta_info`), so it stays with its dialogue however the trainer reorders rows (balancing). The scalar goes on the row's
last token with
`response_mask == 1` (the agent's last sampled token); error rows (all-zero mask) get no reward.

Components, with `raw` the unit-weight value and the weighted value `w * raw` (ranges from the scenario's
state dimensions, span_d = max_d - min_d, sign_d = +1 where higher values are better for the user and -1 where
lower ones are; helpers shared with `llm_agent.metrics`):

- completion = [outcome == completed]
- state_transition = mean over the dimensions of sign_d * (last - first) / span_d, where the values of a dimension
  are the sampled initial state followed by the simulator's reported states over the turns (the same start point
  as the improvement metrics, EI/TI/CI; 0 for a dimension with fewer than two values)
- profile_accuracy = mean over paired turns (see `llm_agent.metrics`) of 1 - mean_d abs(agent_d - user_d) / span_d
  (0 with no paired turn)
- false_positive = -[the agent's status on its last turn is `completed` and outcome != completed]
- turn_efficiency = [completed] * (1 - num_turns / turn_efficiency_max_turns)
- format = -format_errors / max(num_turns, 1)

Penalties have negative raw values, so every weight is a positive "how much it matters". Default weights
reproduce the original SEAD reward: completion 10, everything else 0 (reward in {0, 10}).

Per-turn components (`reward.kwargs.turn_weights`, all 0 by default), from each agent turn's signals
(`llm_agent.diagnosis.signals`):

- state_change = the mean over the dimensions of sign_d * the user's state change the turn caused / span_d (a
  dialogue's sum is its raw state_transition)
- stage_progress = how much further along the SOP the agent's reported stage moved in this turn, / (stages - 1)
- format = -[the turn broke the tag protocol]

With any turn weight non-zero, turn k's weighted sum goes into `batch["turn_scores"]` on the turn's last token
(the per-turn process reward of docs/turn_level_credit.md, read by `adv_estimator=turn_mixed` / `turn_gae`; not
part of the trajectory reward above, so GRPO, dynamic sampling and validation are unchanged) and into the row's
`turn_rewards`. Each record gets its `reward`, `reward_components` and `turn_rewards`; every scored batch also gets
`non_tensor_batch["turn_labels"]`: per row its turns' failure labels
(None for an error row), read by `algorithm.diagnosis_reweight`.
"""
from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from llm_agent.diagnosis import annotate_record, turn_label_lists
from llm_agent.metrics import claimed_done, dimension_values, paired_errors, record_label, records_from_batch
from llm_agent.rollout.dialogue_record import DialogueRecord, TurnRecord
from llm_agent.scenario import Scenario, load_scenario
from verl.protocol import DataProto
from verl.trainer.ppo.plugins import BatchOutputs, declare_outputs
from verl.trainer.ppo.turn_layout import TURN_LABELS, TURN_SCORES
from verl.utils.agent_turns import agent_turn_ids

logger = logging.getLogger(__name__)

__all__ = ["COMPONENTS", "DEFAULT_TURN_WEIGHTS", "DEFAULT_WEIGHTS", "TURN_COMPONENTS", "batch_outputs",
           "compute_reward", "raw_components", "raw_turn_components", "resolve_turn_weights", "resolve_weights"]

COMPONENTS: tuple[str, ...] = ("completion", "state_transition", "profile_accuracy", "false_positive",
                               "turn_efficiency", "format")
DEFAULT_WEIGHTS: dict[str, float] = {name: 10.0 if name == "completion" else 0.0 for name in COMPONENTS}
TURN_COMPONENTS: tuple[str, ...] = ("state_change", "stage_progress", "format")
DEFAULT_TURN_WEIGHTS: dict[str, float] = {name: 0.0 for name in TURN_COMPONENTS}


def _resolve(weights: Mapping[str, Any] | None, defaults: Mapping[str, float], key: str) -> dict[str, float]:
    """`defaults` overridden by `weights`; ValueError naming `reward.kwargs.<key>` on an unknown component or a
    non-finite/non-number weight."""
    if weights is None:
        return dict(defaults)
    if not isinstance(weights, Mapping):
        raise ValueError(f"reward.kwargs.{key} must be a mapping component -> float, got {type(weights).__name__}")
    unknown = sorted(str(k) for k in weights if k not in defaults)
    if unknown:
        raise ValueError(f"reward.kwargs.{key}: unknown component(s) {unknown}; valid components: {list(defaults)}")
    out = dict(defaults)
    for name, value in weights.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(f"reward.kwargs.{key}.{name} must be a finite number, got {value!r}")
        out[name] = float(value)
    return out


def resolve_weights(weights: Mapping[str, Any] | None) -> dict[str, float]:
    """DEFAULT_WEIGHTS overridden by `weights`; ValueError on an unknown component or a non-finite/non-number."""
    return _resolve(weights, DEFAULT_WEIGHTS, "weights")


def resolve_turn_weights(turn_weights: Mapping[str, Any] | None) -> dict[str, float]:
    """DEFAULT_TURN_WEIGHTS overridden by `turn_weights`; ValueError as `resolve_weights`."""
    return _resolve(turn_weights, DEFAULT_TURN_WEIGHTS, "turn_weights")


def raw_turn_components(turns: Sequence[TurnRecord]) -> list[dict[str, float]]:
    """The unit-weight per-turn components (module docstring) of an annotated record's turns, in turn order."""
    return [{"state_change": float(t.signals.state_change), "stage_progress": float(t.signals.stage_progress),
             "format": -float(t.signals.format_error)} for t in turns]


def raw_components(record: DialogueRecord, scenario: Scenario, max_turns: int | None,
                   where: str = "dialogue") -> dict[str, float]:
    """The unit-weight value of every component for one non-error record (see the module docstring).

    `turn_efficiency` is left out when `max_turns` is None; a record with more turns than `max_turns` raises.
    """
    outcome, turns, num_turns = record.outcome, record.turns, record.num_turns
    completed = float(outcome == "completed")
    schema = scenario.state_schema
    spans, profile = schema.spans, record.profile
    transition = sum(d.sign * _span_delta([int(profile[d.name])] if profile.get(d.name) is not None else [], turns,
                                          d.name, d.span) for d in schema.dimensions) / len(schema.dimensions)
    errors = paired_errors(turns, spans)
    raw = {
        "completion": completed,
        "state_transition": transition,
        "profile_accuracy": math.fsum(1.0 - e for e in errors) / len(errors) if errors else 0.0,
        "false_positive": -float(claimed_done(turns, schema.statuses.completed) and outcome != "completed"),
        "format": -record.format_errors / max(num_turns, 1),
    }
    if max_turns is not None:
        if num_turns > max_turns:
            raise ValueError(f"{where}: num_turns={num_turns} exceeds reward.kwargs.turn_efficiency_max_turns="
                             f"{max_turns}; set it to the rollout loop's max_turns")
        raw["turn_efficiency"] = completed * (1.0 - num_turns / max_turns)
    return raw


def _span_delta(initial: list[int], turns: Sequence[TurnRecord], dim: str, span: int) -> float:
    """(last - first) / span of one dimension: the sampled initial state, then the simulator's reported states
    (the same start point as the EI/TI/CI metrics); 0 with fewer than two values."""
    values = [*initial, *dimension_values(turns, "user", dim)]
    return (values[-1] - values[0]) / span if len(values) >= 2 else 0.0


def _last_agent_positions(response_mask: torch.Tensor) -> torch.Tensor:
    """Per row, the index of the last token with mask 1, or -1 when there is none."""
    positions = torch.arange(response_mask.shape[1], device=response_mask.device).expand_as(response_mask)
    return torch.where(response_mask.bool(), positions, torch.full_like(positions, -1)).max(dim=-1).values


def _turn_ends(data: DataProto) -> tuple[torch.Tensor, list[int]]:
    """((bs, K) position of each agent turn's last token, -1 for an absent turn; each row's number of agent turns
    (one more than its largest agent-turn id)), from the batch's `agent_turn_ids` or its `response_mask` runs."""
    ids = agent_turn_ids(data.batch)
    counts = (ids.max(dim=1).values + 1).clamp(min=0)
    num_turns = int(counts.max()) if counts.numel() else 0
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    ends = torch.full((ids.shape[0], num_turns), -1, dtype=torch.long, device=ids.device)
    if num_turns:
        ends.scatter_reduce_(1, ids.clamp(min=0), torch.where(ids >= 0, positions, -1), reduce="amax")
    return ends, counts.tolist()


def batch_outputs(kwargs: Mapping[str, Any]) -> BatchOutputs:
    """What `compute_reward` writes with `reward.kwargs` `kwargs`: the failure labels always, the per-turn rewards
    when a turn weight is non-zero (a bad weight is a ValueError naming its key)."""
    per_turn = any(value != 0.0 for value in resolve_turn_weights(kwargs.get("turn_weights")).values())
    names = ", ".join(f"reward.kwargs.turn_weights.{name}" for name in TURN_COMPONENTS)
    return BatchOutputs(written=frozenset({TURN_LABELS, *([TURN_SCORES] if per_turn else [])}),
                        enabled_by={TURN_SCORES: f"one of {names} is non-zero (all 0 by default), e.g. "
                                                 "reward.kwargs.turn_weights.state_change=1.0"})


@declare_outputs(batch_outputs)
def compute_reward(data: DataProto, tokenizer: Any, scenario: str | None = None,
                   weights: Mapping[str, Any] | None = None,
                   turn_efficiency_max_turns: int | None = None,
                   turn_weights: Mapping[str, Any] | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Score every dialogue of `data` (a DataProto from the SEAD rollout loop); returns (rewards (B, R), metrics).

    `tokenizer` is part of the trainer's plug-in signature and unused (records are already parsed). `scenario`
    is the scenario YAML path (the run's one `Scenario`: `load_scenario` parses a file once per process);
    `weights` overrides DEFAULT_WEIGHTS per component; `turn_efficiency_max_turns` is required when the
    turn_efficiency weight is non-zero; `turn_weights` overrides DEFAULT_TURN_WEIGHTS per per-turn component.

    Metrics (the trainer logs them under `reward/`): `<name>` (weighted) and `raw/<name>` (unit weight) means over
    non-error rows for every component (raw turn_efficiency only when max_turns is known), and `total`; 0 when
    every row is an error; `turn/<name>`, `turn/raw/<name>` and `turn/total`, the same over the agent turns of the
    non-error rows. Side effects: sets every record's `reward_components` (dict of weighted values, all 0 for error
    rows) and `reward` (float), and writes `non_tensor_batch["turn_labels"]`; with a non-zero turn weight also
    `batch["turn_scores"]` and each record's `turn_rewards` (the weighted per-turn totals, None for an error
    row). A record whose turn count differs from its row's agent
    turns is a ValueError naming it. A non-error row without any agent token keeps its score in `reward` but gets
    nothing in the tensors; it is warned about and counted in `unplaced_rows`.
    """
    if not scenario:
        raise ValueError("reward.kwargs.scenario is required: the scenario YAML path (its state_ranges normalise "
                         "the state components)")
    w = resolve_weights(weights)
    tw = resolve_turn_weights(turn_weights)
    per_turn = any(value != 0.0 for value in tw.values())
    if turn_efficiency_max_turns is not None and (isinstance(turn_efficiency_max_turns, bool) or not isinstance(
            turn_efficiency_max_turns, int) or turn_efficiency_max_turns < 1):
        raise ValueError(f"reward.kwargs.turn_efficiency_max_turns must be a positive int, got "
                         f"{turn_efficiency_max_turns!r}")
    if w["turn_efficiency"] != 0.0 and turn_efficiency_max_turns is None:
        raise ValueError("reward.kwargs.weights.turn_efficiency is non-zero but reward.kwargs."
                         "turn_efficiency_max_turns is not set (use the rollout loop's max_turns)")
    if data.batch is None or "response_mask" not in data.batch.keys():
        raise KeyError("compute_reward needs batch['response_mask'] (1 on agent-sampled tokens) from the rollout "
                       "loop llm_agent.generation.LLMGenerationManager")
    loaded = load_scenario(str(scenario))
    records = records_from_batch(data)
    for i, record in enumerate(records):
        if not record.annotated:  # the loop annotates its records; others are annotated here
            annotate_record(record, loaded, record_label(record, i))
    response_mask = data.batch["response_mask"]
    last = _last_agent_positions(response_mask)
    ends, turn_counts = _turn_ends(data)
    reward_tensor = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    turn_scores = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    components: list[dict[str, float]] = []
    labels = np.empty(len(records), dtype=object)
    totals = np.zeros(len(records), dtype=np.float64)
    raw_rows: list[dict[str, float]] = []
    raw_turns: list[dict[str, float]] = []
    unplaced = []
    for i, record in enumerate(records):
        where = record_label(record, i)
        record.turn_rewards = None
        if record.outcome == "error":
            components.append({name: 0.0 for name in COMPONENTS})
            record.reward, record.reward_components = 0.0, components[-1]
            continue
        raw = raw_components(record, loaded, turn_efficiency_max_turns, where)
        raw_rows.append(raw)
        weighted = {name: w[name] * raw.get(name, 0.0) for name in COMPONENTS}
        components.append(weighted)
        totals[i] = math.fsum(weighted.values())
        record.reward, record.reward_components = float(totals[i]), weighted
        turns = record.turns
        row_turns = raw_turn_components(turns)
        raw_turns.extend(row_turns)
        scores = [math.fsum(tw[name] * raw_turn[name] for name in TURN_COMPONENTS) for raw_turn in row_turns]
        if per_turn:
            record.turn_rewards = scores
        if last[i] < 0:
            unplaced.append(record.dialogue_id or i)
            continue
        if turn_counts[i] != len(turns):
            raise ValueError(f"{where}: the record has {len(turns)} agent turns but its row's response has "
                             f"{turn_counts[i]} (agent_turn_ids, or runs of response_mask): rows and records are "
                             "misaligned")
        reward_tensor[i, last[i]] = totals[i]
        labels[i] = turn_label_lists(record)
        for k, score in enumerate(scores):
            turn_scores[i, ends[i, k]] = score
    if unplaced:
        logger.warning("%d non-error dialogue(s) have no agent token (response_mask all 0); their reward is "
                       "dropped: %s", len(unplaced), unplaced[:5])
    data.non_tensor_batch[TURN_LABELS] = labels
    if per_turn:
        data.batch[TURN_SCORES] = turn_scores
    metrics = _reward_metrics(raw_rows, components, totals, records)
    metrics.update(_turn_metrics(raw_turns, tw))
    metrics["unplaced_rows"] = float(len(unplaced))
    return reward_tensor, metrics


def _turn_metrics(raw_turns: list[dict[str, float]], tw: Mapping[str, float]) -> dict[str, float]:
    """Means over the agent turns of the non-error rows of the weighted and raw per-turn components and their
    weighted total."""
    n = len(raw_turns)
    metrics = {}
    for name in TURN_COMPONENTS:
        raw_mean = math.fsum(t[name] for t in raw_turns) / n if n else 0.0
        metrics[f"turn/raw/{name}"] = raw_mean
        metrics[f"turn/{name}"] = tw[name] * raw_mean
    metrics["turn/total"] = math.fsum(metrics[f"turn/{name}"] for name in TURN_COMPONENTS)
    return metrics


def _reward_metrics(raw_rows: list[dict[str, float]], components: list[dict[str, float]],
                    totals: np.ndarray, records: list[DialogueRecord]) -> dict[str, float]:
    """Means over the non-error rows of the weighted and raw components and of the total."""
    scored = [i for i, r in enumerate(records) if r.outcome != "error"]
    n = len(scored)
    metrics: dict[str, float] = {}
    for name in COMPONENTS:
        metrics[name] = math.fsum(components[i][name] for i in scored) / n if n else 0.0
        if all(name in raw for raw in raw_rows):
            metrics[f"raw/{name}"] = math.fsum(raw[name] for raw in raw_rows) / n if n else 0.0
    metrics["total"] = math.fsum(totals[i] for i in scored) / n if n else 0.0
    return metrics
