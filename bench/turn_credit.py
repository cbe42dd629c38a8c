"""Benchmark: the driver's cost of the turn-level credit options beside the estimators they replace.

    python -m bench.turn_credit [--rows 480] [--response-length 6144] [--turns 15] [--repeats 5]
                                [--out bench/results/turn_credit.json]

One random dialogue batch of the GPU preset's shape (60 prompts x 8 dialogues, a 6144-token response budget, up
to 15 agent turns of 60-250 tokens with 20-120-token user turns between them, right padding, 8 rows per prompt
group) goes through ``compute_advantage`` (the trainer's call, on the driver's CPU) with ``grpo`` (SEAD's
default), ``gae``, ``turn_mixed`` and ``turn_gae``, and through the diagnosis reweighting after ``grpo`` (a
third of the turns labelled). Each is run ``--repeats`` times, alternating; printed and written: the median
wall time per step in ms and its ratio to ``grpo``.
"""
from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from bench.results import write_result
from verl.protocol import DataProto
from verl.trainer.ppo.diagnosis_reweight import reweight_advantages
from verl.trainer.ppo.ray_trainer import compute_advantage

REPO = Path(__file__).resolve().parents[1]
LABELS = ("doubt_unanswered", "false_claim", "premature_push", "format_error")
WEIGHTS = {"doubt_unanswered": 1.5, "false_claim": 2.0, "premature_push": 1.2}
logger = logging.getLogger("bench.turn_credit")


def dialogue_batch(rows: int, length: int, max_turns: int, group: int, seed: int) -> DataProto:
    """Random dialogue rows with outcome rewards, per-turn scores, values and per-turn labels."""
    rng = random.Random(seed)
    mask = torch.zeros(rows, length, dtype=torch.long)
    turn_scores = torch.zeros(rows, length)
    rewards = torch.zeros(rows, length)
    labels = np.empty(rows, dtype=object)
    for row in range(rows):
        position, turns = 0, []
        for _ in range(rng.randint(2, max_turns)):
            span = rng.randint(60, 250)
            if position + span > length:
                break
            mask[row, position:position + span] = 1
            turn_scores[row, position + span - 1] = rng.uniform(-1, 1)
            turns.append([rng.choice(LABELS)] if rng.random() < 1 / 3 else [])
            position += span + rng.randint(20, 120)
        last = int(mask[row].nonzero().max())
        rewards[row, last] = rng.choice([0.0, 10.0])
        labels[row] = turns
    uid = np.array([f"p{row // group}" for row in range(rows)], dtype=object)
    return DataProto.from_dict(tensors={"response_mask": mask, "token_level_rewards": rewards,
                                        "turn_scores": turn_scores, "values": torch.randn(rows, length) * mask},
                               non_tensors={"uid": uid, "turn_labels": labels})


def run_once(batch: DataProto, option: str) -> float:
    """Seconds of one advantage computation (plus the reweighting for ``grpo+diagnosis``)."""
    data = DataProto(batch=batch.batch.clone(), non_tensor_batch=dict(batch.non_tensor_batch))
    start = time.perf_counter()
    if option == "grpo+diagnosis":
        compute_advantage(data, "grpo")
        reweight_advantages(data, WEIGHTS, "all")
    else:
        compute_advantage(data, option, gamma=1.0, lam=0.95, config={"gamma": 1.0, "lam": 0.95,
                                                                     "turn_mixed": {"turn_weight": 1.0}})
    return time.perf_counter() - start


def main() -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=480)
    parser.add_argument("--response-length", type=int, default=6144)
    parser.add_argument("--turns", type=int, default=15)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "turn_credit.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    load_at_start = os.getloadavg()[0]
    batch = dialogue_batch(args.rows, args.response_length, args.turns, args.group, args.seed)
    options = ["grpo", "grpo+diagnosis", "turn_mixed", "gae", "turn_gae"]
    times: dict[str, list[float]] = {option: [] for option in options}
    for _ in tqdm(range(args.repeats), desc="repeats"):
        for option in options:
            times[option].append(run_once(batch, option))
    medians = {option: statistics.median(values) for option, values in times.items()}
    agent_tokens = int(batch.batch["response_mask"].sum())
    logger.info("%d rows x %d tokens (%d agent tokens), median of %d runs, torch threads %d", args.rows,
                args.response_length, agent_tokens, args.repeats, torch.get_num_threads())
    logger.info("| option | median ms | / grpo |\n|---|---|---|")
    for option in options:
        logger.info("| %s | %.1f | %.2f |", option, medians[option] * 1e3, medians[option] / medians["grpo"])
    write_result(args, load_at_start, {"torch": torch.__version__, "torch_threads": torch.get_num_threads()},
                 agent_tokens=agent_tokens, seconds=times, median_ms={k: v * 1e3 for k, v in medians.items()},
                 ratio_to_grpo={k: v / medians["grpo"] for k, v in medians.items()})


if __name__ == "__main__":
    main()
