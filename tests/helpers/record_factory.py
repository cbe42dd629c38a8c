"""Seeded random dialogue records in the rollout log's JSON format, for the reward and metrics tests (`typed` reads
them as the `DialogueRecord`s the loop makes; the reference computations read the plain dicts).

They cover every outcome (errors included), format-error turns, cached turns, missing tags (None values or a
None state) and non-monotone stage sequences, so the independent reference computations meet every branch.
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from llm_agent.rollout.dialogue_record import DIALOGUE_KEY, DialogueRecord
from llm_agent.scenario import Scenario, scenario_path
from tests.helpers.profiles import DIMS
from verl.protocol import DataProto

SCENARIO_PATH = str(scenario_path("inbound_support"))
OUTCOME_WEIGHTS = {"completed": 4, "hung_up": 2, "agent_ended": 2, "timeout": 1, "truncated": 1, "error": 1}
MAX_TURNS = 8


def _state(rng: random.Random, scenario: Scenario, p_none: float) -> dict[str, int | None]:
    return {d: None if rng.random() < p_none else rng.randint(scenario.state_ranges[d].min,
                                                                scenario.state_ranges[d].max) for d in DIMS}


def random_turn(rng: random.Random, scenario: Scenario, stage: int, last: bool) -> dict[str, Any]:
    """One agent turn and what followed it: ~12% format errors, ~20% cached replies, some missing tags."""
    if rng.random() < 0.12:
        return {"agent_text": "garbled", "agent_reply": None, "agent_stage": None, "agent_status": None,
                "agent_state": {d: None for d in DIMS}, "agent_format_ok": False,
                "user_reply": "(format note)", "user_status": None, "user_state": None,
                "user_source": "format_error", "user_error": None}
    status = rng.choice([0, 0, 1, 1, -1]) if last else 0
    source = rng.choices(["simulator", "cache", None], weights=[7, 2, 1 if last else 0])[0]
    user_state = None if source is None or rng.random() < 0.08 else _state(rng, scenario, 0.1)
    return {"agent_text": f"<reply>hi {stage}</reply>", "agent_reply": f"hi {stage}",
            "agent_stage": None if rng.random() < 0.1 else stage, "agent_status": status,
            "agent_state": _state(rng, scenario, 0.1), "agent_format_ok": True,
            "user_reply": None if source is None else "ok", "user_status": None if source is None else 0,
            "user_state": user_state, "user_source": source, "user_error": None}


def random_record(rng: random.Random, scenario: Scenario, index: int) -> dict[str, Any]:
    """A random dialogue record with all the keys the rollout loop writes (before the reward's own keys)."""
    outcome = rng.choices(list(OUTCOME_WEIGHTS), weights=list(OUTCOME_WEIGHTS.values()))[0]
    num_turns = rng.randint(0, 3) if outcome == "error" else rng.randint(1, MAX_TURNS)
    stage_ids = scenario.stage_ids
    turns, pos = [], 0
    for k in range(num_turns):
        turns.append(random_turn(rng, scenario, stage_ids[pos], last=k == num_turns - 1))
        pos = min(len(stage_ids) - 1, max(0, pos + rng.choice([0, 1, 1, 2, -1])))
    profile = {**_state(rng, scenario, 0.0), "behaviors": [{"category": "busy", "behavior": "Is busy."}]}
    uid = f"u{index // 4}"
    return {"uid": uid if outcome != "error" else f"{uid}/error/{uid}#{index % 4}",
            "dialogue_id": f"{uid}#{index % 4}", "profile": profile,
            "state_key": f"c{profile['cooperation']}-e{profile['emotion']}-t{profile['trust']}",
            "outcome": outcome, "num_turns": num_turns, "turns": turns, "messages": [],
            "cache_hits": sum(t["user_source"] == "cache" for t in turns),
            "format_errors": sum(not t["agent_format_ok"] for t in turns),
            "sim_retries": rng.choice([0, 0, 0, 1, 2]),
            "error": "simulator down" if outcome == "error" else None,
            "agent_tokens": rng.randint(0, 40) * num_turns, "sim_requests": rng.randint(0, num_turns + 2),
            "wall_s": round(rng.uniform(0.01, 3.0), 4)}


def random_records(seed: int, n: int, scenario: Scenario) -> list[dict[str, Any]]:
    """`n` records from a seeded generator."""
    rng = random.Random(seed)
    return [random_record(rng, scenario, i) for i in range(n)]


def typed(records: list[dict[str, Any]]) -> list[DialogueRecord]:
    """The records as `DialogueRecord`s (each named as the metrics name a record: index and dialogue id)."""
    return [DialogueRecord.from_dict(r, f"record {i} (dialogue_id {r.get('dialogue_id')!r})")
            for i, r in enumerate(records)]


def object_column(values: list[Any]) -> np.ndarray:
    """A 1-D object array with one element per value (never a 2-D array of lists)."""
    arr = np.empty(len(values), dtype=object)
    arr[:] = values
    return arr


def random_mask_row(rng: random.Random, length: int, turns: int) -> tuple[list[int], int]:
    """A response_mask row with `turns` agent spans (1-3 tokens), a masked user block (1-3 tokens) after each,
    then padding; `turns` 0 is an error row (all zero).

    Returns (mask, index of the last 1) — the last index is -1 for error rows.
    """
    mask: list[int] = []
    for _ in range(turns):
        mask += [1] * rng.randint(1, 3) + [0] * rng.randint(1, 3)
    if len(mask) > length:
        raise ValueError(f"{turns} turns do not fit a response of {length} tokens")
    last = max((i for i, m in enumerate(mask) if m == 1), default=-1)
    return mask + [0] * (length - len(mask)), last


def batch_of(records: list[dict[str, Any]], seed: int, length: int = 48) -> tuple[DataProto, list[int]]:
    """A DataProto holding `records` (typed, in the `dialogue` column, as the rollout loop puts them, and their
    `uid`) with hand-built response masks, one agent span per turn of each non-error record; returns it and the
    expected position of each row's reward."""
    rng = random.Random(seed)
    rows = [random_mask_row(rng, length, 0 if r["outcome"] == "error" else r["num_turns"]) for r in records]
    mask = torch.tensor([m for m, _ in rows], dtype=torch.long)
    responses = torch.where(mask.bool(), torch.randint(3, 1000, mask.shape), torch.zeros_like(mask))
    non_tensors = {"uid": object_column([r["uid"] for r in records]), DIALOGUE_KEY: object_column(typed(records))}
    data = DataProto.from_dict(tensors={"responses": responses, "response_mask": mask}, non_tensors=non_tensors)
    return data, [last for _, last in rows]
