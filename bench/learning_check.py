"""Does the state controller move its sampling weights as its rule says? An independent check for bench.learning.

`controller_check` replays a training run: for every step it takes that step's training dialogues from the
rollout log (their sampled initial state and outcome), recomputes the SEAD rule of llm_agent/controller.py in
float64 from scratch (per value: success rate, rule weight, normalisation, smoothing with the previous step's
logged weights, then the floor / max-ratio bound as an iterated clip-and-renormalise) and compares the result
with the weights the trainer logged (`controller/weight/<dim>=<value>`). It also states the direction of each
move: below target - dead band the rule shifts mass toward values that completed more (easy), above target +
dead band toward values that completed less (hard), inside the band it stays near uniform.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

DIMS = ("cooperation", "emotion", "trust")


def _bounded(weights: list[float], floor: float, max_ratio: float, rounds: int = 10_000) -> list[float]:
    """Clip every weight up to max(floor, max/max_ratio) and renormalise, until nothing changes."""
    w = [x / sum(weights) for x in weights]
    for _ in range(rounds):
        level = max(floor, max(w) / max_ratio)
        lifted = [max(x, level) for x in w]
        new = [x / sum(lifted) for x in lifted]
        if max(abs(a - b) for a, b in zip(new, w)) < 1e-15:
            return new
        w = new
    return w


def _rule(deviation: float, band: float, done: int, count: int) -> float:
    """The unnormalised weight of one value (unseen values: success 0.5 over one dialogue)."""
    rate, count = (done / count, count) if count else (0.5, 1)
    if deviation < -band:
        return 1.0 + 2.0 * abs(deviation) * rate
    if deviation > band:
        return 1.0 + 2.0 * deviation * (1.0 - rate)
    return 1.0 + 0.1 / count


def _state(key: str) -> tuple[int, int, int]:
    c, e, t = (int(part[1:]) for part in key.split("-"))
    return c, e, t


def controller_check(train_steps: Sequence[Mapping[str, Any]], rollouts: Sequence[Mapping[str, Any]],
                     values: Mapping[str, Sequence[int]], settings: Mapping[str, float]) -> dict[str, Any]:
    """Per step: CR, deviation, mode, per-value (completed, count), logged and recomputed weights, and their
    largest difference; plus the largest difference over the run.

    `train_steps` holds per step `{"step", "controller": {"weight/<dim>=<v>": w, ...}}` (the trainer's
    `controller/` metrics without the prefix); `rollouts` the rollout log's training lines; `values` the valid
    values per dimension; `settings` the controller's target_completion_rate, dead_band, smoothing, floor and
    max_ratio.
    """
    target, band = settings["target_completion_rate"], settings["dead_band"]
    previous = {d: [1.0 / len(values[d])] * len(values[d]) for d in DIMS}
    rows, worst = [], 0.0
    for step in train_steps:
        dialogues = [r for r in rollouts if r["step"] == step["step"] and r["outcome"] != "error"]
        if not dialogues:
            continue
        done = [r["outcome"] == "completed" for r in dialogues]
        cr = sum(done) / len(done)
        deviation = cr - target
        mode = "toward easy" if deviation < -band else "toward hard" if deviation > band else "dead band"
        row: dict[str, Any] = {"step": step["step"], "n": len(done), "cr": cr, "deviation": deviation, "mode": mode,
                               "dims": {}}
        for i, dim in enumerate(DIMS):
            tally = {v: [0, 0] for v in values[dim]}
            for record, ok in zip(dialogues, done):
                tally[_state(record["state_key"])[i]][0] += ok
                tally[_state(record["state_key"])[i]][1] += 1
            raw = [_rule(deviation, band, *tally[v]) for v in values[dim]]
            target_w = [x / sum(raw) for x in raw]
            mixed = [(1 - settings["smoothing"]) * old + settings["smoothing"] * new
                     for old, new in zip(previous[dim], target_w)]
            expected = _bounded(mixed, settings["floor"], settings["max_ratio"])
            logged = [step["controller"][f"weight/{dim}={v}"] for v in values[dim]]
            diff = max(abs(a - b) for a, b in zip(expected, logged))
            worst = max(worst, diff)
            row["dims"][dim] = {"values": list(values[dim]), "completed_count": [tally[v] for v in values[dim]],
                                "before": previous[dim], "logged": logged, "recomputed": expected,
                                "max_abs_diff": diff}
            previous[dim] = logged
        rows.append(row)
    return {"settings": dict(settings), "steps": rows, "max_abs_diff": worst}


def _move(dim_row: Mapping[str, Any]) -> str:
    """`v up (CR x), w down (CR y)`: the values whose logged weight rose and fell most this step."""
    deltas = [after - before for after, before in zip(dim_row["logged"], dim_row["before"])]
    up, down = deltas.index(max(deltas)), deltas.index(min(deltas))

    def rate(k: int) -> str:
        done, count = dim_row["completed_count"][k]
        return f"{done}/{count}" if count else "-"
    values = dim_row["values"]
    return f"{values[up]}+ ({rate(up)}) {values[down]}- ({rate(down)})"


def controller_table(check: Mapping[str, Any]) -> str:
    """A plain-text table of the check: per step CR, mode, and per dimension which value gained and lost weight
    (with its completed/count), and the recomputation's largest difference."""
    lines = [f"\nController (target CR {check['settings']['target_completion_rate']}, dead band "
             f"{check['settings']['dead_band']}): per step, per dimension the value that gained (+) and lost (-) "
             "most weight, with its completed/count", f"{'step':>4} | {'CR':>5} | {'mode':<11} | "
             + " | ".join(f"{d:<22}" for d in DIMS) + " | max|diff|"]
    for row in check["steps"]:
        moves = " | ".join(f"{_move(row['dims'][d]):<22}" for d in DIMS)
        diff = max(row["dims"][d]["max_abs_diff"] for d in DIMS)
        lines.append(f"{row['step']:>4} | {row['cr']:>5.3f} | {row['mode']:<11} | {moves} | {diff:.1e}")
    ok = check["max_abs_diff"] < 1e-6
    lines.append(f"check: logged weights {'match' if ok else 'DO NOT match'} the independent recomputation of the "
                 f"rule (largest difference {check['max_abs_diff']:.1e})")
    return "\n".join(lines)


def valid_values(scenario_path: str | Path) -> dict[str, list[int]]:
    """The controller's valid values per dimension: each range without its extremes."""
    from llm_agent.scenario import load_scenario

    ranges = load_scenario(scenario_path).state_ranges
    return {d: list(range(ranges[d].min + 1, ranges[d].max)) for d in DIMS}
