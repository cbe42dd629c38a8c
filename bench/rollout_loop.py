"""Benchmark: the rollout loop's own cost per dialogue-turn, and the user-response cache's savings.

    python -m bench.rollout_loop [--dialogues 480] [--turns 4 8 16 32] [--repeats 3] [--cache-turns 16]
                                 [--cache-steps 5] [--out bench/results/rollout_loop.json]

Part 1 (overhead): `LLMGenerationManager.run_llm_loop` runs `--dialogues` dialogues (the training path:
controller on, cache off) for each number of turns, with an instant policy (`ScriptedPolicyWorkerGroup(
instant=True)`: a fixed, well-formed turn per stage, never ending the call) and an instant simulator
(`InProcessUserSim(never_end=True)`: a reply from a precomputed pool, never ending the call), so every dialogue
runs exactly `max_turns` turns and nearly all the time is the loop's own work: building the left-padded context
batch, appending tokens, decoding and parsing agent turns, rendering simulator requests, tokenizing user
turns, and the final tensors and records. The per-dialogue-turn time is wall time / (dialogues x turns); the
time inside the stand-ins' own `generate_sequences` and `complete` (timed by thin wrappers) is reported
separately, and "loop only" excludes both. A loop whose per-turn work grew with the context would show a
32-turn/4-turn ratio well above 1.

Part 2 (cache): `--cache-steps` training steps of `--dialogues` dialogues x `--cache-turns` turns with the
cache on (the original's stage hit rates 0.9 / 0.5 / 0.2 / 0.0, min bucket 10, file in a temporary directory).
The instant policy's stage cycles through the scenario's stages turn by turn, so each stage gets a quarter of the
user turns. Per step: user turns, simulator calls, calls saved by the cache; per stage: the configured rate, the
measured hit rate among eligible lookups (bucket full, previous turn not a hit: should equal the configured
rate), and the share of all lookups served (lower, since a hit is never followed by another hit).
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer

from bench.results import write_result
from llm_agent.envs import ChatMarkers
from llm_agent.generation import LLMGenerationManager
from llm_agent.rollout.dialogue_record import records_from_batch
from llm_agent.scenario import DEFAULT_SCENARIO_PATH, load_scenario
from llm_agent.stand_ins.scripted_policy import ScriptedPolicyWorkerGroup
from llm_agent.stand_ins.inprocess_user_sim import InProcessUserSim, never_ending_replies
from llm_agent.user_sim.client import SimulatorClient
from utils.make_tiny_model import build_tiny_model
from verl.protocol import DataProto
from verl.utils.torch_functional import compute_position_id_with_mask
from verl.workers.rollout.engine import RolloutEngine

logger = logging.getLogger("bench.rollout_loop")

REPO = Path(__file__).resolve().parents[1]
SCENARIO = DEFAULT_SCENARIO_PATH
GROUP_SIZE = 8  # rows per uid (GRPO n)
STAGE_RATES = {0: 0.9, 1: 0.5, 2: 0.2, 3: 0.0}


class TimedPolicy(RolloutEngine):
    """The instant policy with the time spent inside its `generate_sequences` added up (`seconds`)."""

    def __init__(self, policy: ScriptedPolicyWorkerGroup) -> None:
        self.policy, self.world_size, self.seconds = policy, policy.world_size, 0.0

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Delegate and time."""
        start = time.perf_counter()
        try:
            return self.policy.generate_sequences(prompts)
        finally:
            self.seconds += time.perf_counter() - start


class TimedSim(SimulatorClient):
    """The instant simulator with the time spent inside its `complete` added up (`seconds`)."""

    def __init__(self, sim: InProcessUserSim) -> None:
        self.sim, self.seconds = sim, 0.0

    def complete(self, requests: list) -> list:
        """Delegate and time."""
        start = time.perf_counter()
        try:
            return self.sim.complete(requests)
        finally:
            self.seconds += time.perf_counter() - start

    def stats(self) -> dict[str, float]:
        """The simulator's counters."""
        return self.sim.stats()

    def reset_stats(self) -> None:
        """Zero the simulator's counters."""
        self.sim.reset_stats()

    def close(self) -> None:
        """Close the simulator."""
        self.sim.close()


def gen_batch(tokenizer: Any, scenario: Any, dialogues: int) -> DataProto:
    """The trainer's generation batch: the agent prompt per row, `GROUP_SIZE` consecutive rows per uid."""
    messages = [{"role": "system", "content": scenario.render_agent_prompt()},
                {"role": "user", "content": scenario.agent_opening}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    enc = tokenizer([text] * dialogues, return_tensors="pt", padding=True, add_special_tokens=False)
    uids = np.empty(dialogues, dtype=object)
    uids[:] = [f"p{i // GROUP_SIZE}" for i in range(dialogues)]
    tensors = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
               "position_ids": compute_position_id_with_mask(enc["attention_mask"])}
    return DataProto.from_dict(tensors, non_tensors={"uid": uids})


def turn_budget(tokenizer: Any, scenario: Any, policy: ScriptedPolicyWorkerGroup) -> int:
    """Tokens one turn can take: the longest instant agent turn + EOS + the longest user block."""
    markers = ChatMarkers.from_tokenizer(tokenizer, tokenizer.eos_token_id)
    agent = max(len(ids) for ids in policy.instant_turn_ids) + 1
    replies = [scenario.parse_user_output(text).reply for text in never_ending_replies(scenario)]
    user = max(len(markers.user_block(tokenizer.encode(r, add_special_tokens=False))) for r in replies)
    return agent + user


def loop_config(turns: int, budget: int, cache: dict[str, Any]) -> dict[str, Any]:
    """`rollout_loop.config` for the benchmark (controller on, as in training)."""
    return {"scenario": str(SCENARIO), "max_turns": turns, "max_tokens_per_turn": 256,
            "max_response_length": max(256, turns * budget), "cache": cache, "seed": 0}


def timed_run(tokenizer: Any, scenario: Any, dialogues: int, turns: int, budget: int) -> dict[str, float]:
    """One `run_llm_loop` with fresh stand-ins; wall time and the time spent inside the policy and the simulator."""
    policy = TimedPolicy(ScriptedPolicyWorkerGroup(tokenizer, scenario, world_size=2, instant=True))
    sim = TimedSim(InProcessUserSim(scenario, never_end=True))
    loop = LLMGenerationManager(tokenizer, policy, loop_config(turns, budget, {"enabled": False}),
                                is_validation=False, client=sim)
    batch = gen_batch(tokenizer, scenario, dialogues)
    start = time.perf_counter()
    out = loop.run_llm_loop(batch)
    wall = time.perf_counter() - start
    records = records_from_batch(out)
    outcomes = {r.outcome for r in records}
    num_turns = {r.num_turns for r in records}
    if outcomes != {"timeout"} or num_turns != {turns}:
        raise RuntimeError(f"set-up error: expected every dialogue to time out after {turns} turns, got outcomes "
                           f"{outcomes} and turn counts {num_turns}")
    loop.close()
    return {"wall_s": wall, "policy_s": policy.seconds, "sim_s": sim.seconds}


def overhead_row(tokenizer: Any, scenario: Any, dialogues: int, turns: int, budget: int, repeats: int) -> dict:
    """Median over `repeats` runs of the per-dialogue-turn times (microseconds) for one number of turns."""
    runs = [timed_run(tokenizer, scenario, dialogues, turns, budget) for _ in range(repeats)]
    per = dialogues * turns / 1e6
    row = {"turns": turns, "dialogue_turns": dialogues * turns, "runs": runs,
           "total_us": statistics.median(r["wall_s"] / per for r in runs),
           "loop_only_us": statistics.median((r["wall_s"] - r["policy_s"] - r["sim_s"]) / per for r in runs),
           "policy_us": statistics.median(r["policy_s"] / per for r in runs),
           "sim_us": statistics.median(r["sim_s"] / per for r in runs)}
    logger.info("%d turns: %.1f us per dialogue-turn (loop only %.1f)", turns, row["total_us"], row["loop_only_us"])
    return row


def cache_run(tokenizer: Any, scenario: Any, dialogues: int, turns: int, steps: int, budget: int) -> dict:
    """`steps` training steps with the cache on; simulator calls saved per step and hit rates per stage."""
    with tempfile.TemporaryDirectory() as tmp:
        cache = {"enabled": True, "path": str(Path(tmp) / "user_responses.jsonl"), "stage_hit_rates": STAGE_RATES,
                 "min_bucket_size": 10, "seed": 0}
        policy = ScriptedPolicyWorkerGroup(tokenizer, scenario, world_size=2, instant=True)
        sim = InProcessUserSim(scenario, never_end=True)
        loop = LLMGenerationManager(tokenizer, policy, loop_config(turns, budget, cache), is_validation=False,
                                    client=sim)
        rows, totals = [], {s: {"lookups": 0, "hits": 0, "eligible": 0} for s in STAGE_RATES}
        for step in range(steps):
            sim.reset_stats()
            out = loop.run_llm_loop(gen_batch(tokenizer, scenario, dialogues))
            user_turns = sum(t.user_source in ("simulator", "cache") for d in records_from_batch(out)
                             for t in d.turns)
            hits = sum(r.cache_hits for r in records_from_batch(out))
            calls = int(sim.stats()["user_sim/turns"])
            if calls + hits != user_turns:
                raise RuntimeError(f"step {step}: {calls} simulator calls + {hits} cache hits != "
                                   f"{user_turns} user turns")
            metrics = loop.cache.metrics(reset=True)
            stages = {}
            for s in STAGE_RATES:
                lookups, stage_hits = metrics[f"cache/lookups/stage{s}"], metrics[f"cache/hits/stage{s}"]
                # the hit rate is left out when no lookup was eligible (undefined)
                rate, eligible = metrics.get(f"cache/hit_rate/stage{s}"), int(metrics[f"cache/eligible/stage{s}"])
                stages[s] = {"lookups": lookups, "hits": stage_hits, "hit_rate_eligible": rate,
                             "served_share": stage_hits / lookups if lookups else 0.0}
                if step > 0:  # the first step fills the buckets
                    totals[s]["lookups"] += lookups
                    totals[s]["hits"] += stage_hits
                    totals[s]["eligible"] += eligible
            rows.append({"step": step, "user_turns": user_turns, "simulator_calls": calls, "saved_calls": hits,
                         "saved_share": hits / user_turns, "cache_size": metrics["cache/size"], "stages": stages})
            logger.info("cache step %d: %d of %d user turns served from the cache", step, hits, user_turns)
        loop.close()
    summary = {}
    for s, t in totals.items():
        p, n = STAGE_RATES[s], t["eligible"]
        measured = t["hits"] / n if n else 0.0
        sigma = math.sqrt(p * (1 - p) / n) if n else 0.0
        if p == 0:
            within: bool | None = t["hits"] == 0
        else:
            within = abs(measured - p) <= 3 * sigma if n else None  # None: no eligible lookup to judge
        summary[s] = {"configured": p, "hit_rate_eligible": measured, "eligible": n, "within_3_sigma": within,
                      "served_share": t["hits"] / t["lookups"] if t["lookups"] else 0.0}
    return {"steps": rows, "stages_after_fill": summary}


def main(argv: list[str] | None = None) -> dict:
    """Time the loop at each number of turns, run the cache steps, print a table and write the JSON results."""
    load_at_start = os.getloadavg()[0]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dialogues", type=int, default=480)
    p.add_argument("--turns", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cache-turns", type=int, default=16)
    p.add_argument("--cache-steps", type=int, default=5)
    p.add_argument("--out", type=Path, default=REPO / "bench/results/rollout_loop.json")
    args = p.parse_args(argv)
    if args.dialogues % GROUP_SIZE or args.dialogues % 2:
        p.error(f"--dialogues must be a multiple of {GROUP_SIZE} (rows per uid) and of the world size 2")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    scenario = load_scenario(SCENARIO)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(Path(tmp) / "tiny", seed=0), padding_side="left")
    budget = turn_budget(tokenizer, scenario, ScriptedPolicyWorkerGroup(tokenizer, scenario, instant=True))
    timed_run(tokenizer, scenario, 2 * GROUP_SIZE, 2, budget)  # warm-up (imports, allocator)
    rows = [overhead_row(tokenizer, scenario, args.dialogues, t, budget, args.repeats) for t in args.turns]
    cache = cache_run(tokenizer, scenario, args.dialogues, args.cache_turns, args.cache_steps, budget)
    first, last = rows[0], rows[-1]
    summary = {f"ratio_{last['turns']}_over_{first['turns']}_total": last["total_us"] / first["total_us"],
               f"ratio_{last['turns']}_over_{first['turns']}_loop_only": last["loop_only_us"] / first["loop_only_us"]}
    result = write_result(args, load_at_start, {"torch_threads": torch.get_num_threads(), "torch": torch.__version__},
                          turn_budget_tokens=budget, overhead=rows, cache=cache, summary=summary)

    lines = [f"{'turns':>5} {'dialogue-turns':>15} {'total us':>9} {'loop only us':>13} {'policy us':>10} "
             f"{'sim us':>7}   per dialogue-turn, median of {args.repeats}"]
    for r in rows:
        lines.append(f"{r['turns']:>5} {r['dialogue_turns']:>15} {r['total_us']:9.1f} {r['loop_only_us']:13.1f} "
                     f"{r['policy_us']:10.1f} {r['sim_us']:7.1f}")
    lines += [f"{k}: {v:.2f}" for k, v in summary.items()]
    lines.append(f"\ncache, {args.dialogues} dialogues x {args.cache_turns} turns per step")
    lines.append(f"{'step':>4} {'user turns':>11} {'sim calls':>10} {'saved':>7} {'saved %':>8} {'size':>6}")
    for r in cache["steps"]:
        lines.append(f"{r['step']:>4} {r['user_turns']:>11} {r['simulator_calls']:>10} {r['saved_calls']:>7} "
                     f"{100 * r['saved_share']:8.1f} {r['cache_size']:6.0f}")
    lines.append(f"{'stage':>5} {'configured':>11} {'hit rate (eligible)':>20} {'eligible':>9} {'<=3 sigma':>10} "
                 f"{'served share':>13}   steps 1..{args.cache_steps - 1}")
    for s, v in cache["stages_after_fill"].items():
        lines.append(f"{s:>5} {v['configured']:11.2f} {v['hit_rate_eligible']:20.3f} {v['eligible']:>9} "
                     f"{str(v['within_3_sigma']):>10} {v['served_share']:13.3f}")
    lines.append(f"written to {args.out}")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
