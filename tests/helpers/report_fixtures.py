"""Synthetic runs for the plot, report and browser tests: main.sh's file layout with known values.

`synthetic_dialogues` makes rollout-log lines (llm_agent.rollout.records.log_lines' format) from a seeded
generator; every `SEARCH_EVERY`-th dialogue's user says the rare word `SEARCH_WORD`, so tests can count the
expected search hits without the code under test. `write_run` writes metrics.jsonl (per-step values the tests
know), val_metrics.jsonl and rollouts.jsonl under `<root>/logs|evaluation|rollouts/<name>/`.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from llm_agent.scenario import Scenario
from tests.helpers.profiles import DIMS

OUTCOME_WEIGHTS = {"completed": 3, "hung_up": 3, "agent_ended": 1, "timeout": 1, "truncated": 1, "error": 1}
SEARCH_WORD = "zucchini"
SEARCH_EVERY = 37
RATE_KEYS = {"completed": "completion_rate", "hung_up": "hang_up_rate", "agent_ended": "agent_ended_rate",
             "timeout": "timeout_rate", "truncated": "truncated_rate", "error": "error_rate"}


def _state(rng: random.Random, scenario: Scenario) -> dict[str, int]:
    return {d: rng.randint(scenario.state_ranges[d].min, scenario.state_ranges[d].max) for d in DIMS}


def synthetic_dialogue(rng: random.Random, scenario: Scenario, index: int, step: int, split: str) -> dict[str, Any]:
    """One rollout-log line with 1-5 turns, cached user turns, format errors and reward components."""
    outcome = rng.choices(list(OUTCOME_WEIGHTS), weights=list(OUTCOME_WEIGHTS.values()))[0]
    n_turns = rng.randint(1, 5)
    turns = []
    for k in range(n_turns):
        ok = rng.random() > 0.1
        source = "format_error" if not ok else rng.choice(["simulator", "simulator", "cache"])
        said = f"user line {k} of dialogue {index}" + (f" about {SEARCH_WORD}" if index % SEARCH_EVERY == 0
                                                        and k == 0 else "")
        turns.append({"agent_text": f"<reply>agent line {k}</reply>" if ok else "garbled",
                      "agent_reply": f"agent line {k}" if ok else None,
                      "agent_stage": scenario.stage_ids[min(k, len(scenario.stage_ids) - 1)] if ok else None,
                      "agent_status": 0, "agent_state": _state(rng, scenario) if ok else None, "agent_format_ok": ok,
                      "user_reply": said if ok else "(format note)", "user_status": 0,
                      "user_state": _state(rng, scenario) if ok else None, "user_source": source,
                      "user_error": None})
    profile = {**_state(rng, scenario),
               "behaviors": [b.to_dict() for b in rng.sample(scenario.behaviors, rng.randint(1, 3))]}
    return {"step": step, "split": split, "uid": f"s{step}_{index}", "dialogue_id": f"s{step}_{index}#0",
            "profile": profile, "state_key": "c{cooperation}-e{emotion}-t{trust}".format(**profile),
            "outcome": outcome, "num_turns": n_turns, "turns": turns, "messages": [],
            "reward": round(rng.uniform(-2, 10), 3),
            "reward_components": {"completion": 10.0 if outcome == "completed" else 0.0, "format": -1.0},
            "cache_hits": sum(t["user_source"] == "cache" for t in turns),
            "format_errors": sum(not t["agent_format_ok"] for t in turns),
            "error": "simulator down" if outcome == "error" else None}


def synthetic_dialogues(scenario: Scenario, n: int, seed: int = 0, steps: int = 10) -> list[dict[str, Any]]:
    """`n` dialogues spread over `steps` steps; every fifth one is a validation dialogue."""
    rng = random.Random(seed)
    return [synthetic_dialogue(rng, scenario, i, 1 + i * steps // n, "val" if i % 5 == 4 else "train")
            for i in range(n)]


def step_metrics(step: int, with_time: bool) -> dict[str, float]:
    """The tracked metrics of one training step of the fixture run (simple functions of the step; the non-error
    outcome rates sum to 1 for steps 1-8)."""
    cr = 0.1 * step
    row = {"step": step, "critic/score/mean": 2.0 * step - 3.0, "dialogue/completion_rate": cr,
           "dialogue/hang_up_rate": 0.5 - 0.05 * step, "dialogue/agent_ended_rate": 0.1,
           "dialogue/timeout_rate": 0.4 - 0.05 * step, "dialogue/truncated_rate": 0.0,
           "dialogue/error_rate": 0.05, "dialogue/att": 3.0, "dialogue/adt": 2.5, "dialogue/format_error_rate": 0.2,
           "actor/ppo_kl": 0.001 * step, "actor/entropy": 1.0 / step, "actor/lr": 1e-5,
           "perf/tokens_per_s": 1000.0 + step, "controller/cr": cr,
           "cache/eligible/stage0": 0.0 if step < 3 else 4.0, "cache/target_hit_rate/stage0": 0.9,
           "cache/hit_rate/stage1": 0.25, "cache/eligible/stage1": 8.0, "cache/target_hit_rate/stage1": 0.5}
    if step >= 3:  # nothing was eligible at stage 0 before step 3: its hit rate is undefined (left out) there
        row["cache/hit_rate/stage0"] = 0.5
    for dim, values in (("cooperation", (1, 2, 3)), ("emotion", (1, 2)), ("trust", (1, 2, 3, 4))):
        for k, v in enumerate(values):
            row[f"controller/weight/{dim}={v}"] = controller_weight(step, k, len(values))
            if (step + k) % 2 == 0:  # some values unseen at some updates
                row[f"controller/cr/{dim}={v}"] = 0.1 * k
    if with_time:
        row.update({"rollout/time_generate_s": 2.0 * step, "rollout/time_user_sim_s": 1.0})
    return row


def controller_weight(step: int, k: int, n: int) -> float:
    """The fixture's weight of the k-th of n values at `step` (sums to 1 over k)."""
    raw = [1.0 + 0.1 * step * j for j in range(n)]
    return raw[k] / sum(raw)


def write_run(root: Path, name: str, scenario: Scenario, steps: int = 6, n_dialogues: int = 120,
              with_time: bool = False, seed: int = 0) -> dict[str, Any]:
    """Write a run in main.sh's layout; returns what was written (the rows and dialogues) for the tests."""
    rows = [step_metrics(s, with_time) for s in range(1, steps + 1)]
    val_rows = {s: {"val/dialogue/completion_rate": 0.05 * s, "val/dialogue/att": 2.0, "val/dialogue/adt": 1.5,
                    "val/reward/total": float(s)} for s in range(2, steps + 1, 2)}
    logs = root / "logs" / name
    logs.mkdir(parents=True)
    with open(logs / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 0, "val/dialogue/completion_rate": 0.0}) + "\n")
        for row in rows:
            f.write(json.dumps({**row, **val_rows.get(row["step"], {})}) + "\n")
    dialogues = synthetic_dialogues(scenario, n_dialogues, seed, steps)
    (root / "rollouts" / name).mkdir(parents=True)
    with open(root / "rollouts" / name / "rollouts.jsonl", "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in dialogues)
    (root / "evaluation").mkdir(exist_ok=True)
    with open(root / "evaluation" / "val_metrics.jsonl", "a") as f:
        for s in val_rows:
            f.write(json.dumps({"step": s, "n_dialogues": 8, "metrics": {"completion_rate": 0.05 * s}}) + "\n")
    return {"rows": rows, "val": val_rows, "dialogues": dialogues}
