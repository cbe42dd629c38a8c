"""Benchmark: the rollout loop in sync and in async mode, side by side (issue 11).

    python -m bench.async_rollout [--dialogues 480] [--turns 10] [--repeats 3] [--median-ms 50] [--sigma 0.6]
                                  [--slow-factor 5] [--batch-wait-ms 5] [--call-ms 20] [--step-ms 0.3]
                                  [--step-row-us 4]
                                  [--out bench/results/async_rollout.json]

`--dialogues` training dialogues (controller on, cache off, so both modes meet the same users) against two
scripted simulator servers on loopback (`python -m llm_agent.user_sim.server`, real HTTP, `UserSimClient`) with
injected lognormal latency, median `--median-ms` and log-sigma `--sigma`, the second `--slow-factor` times
slower. The agent is the scripted agent (`ScriptedPolicyWorkerGroup`), its quality cycling over the prompt
groups (good, evasive, bad; the group number is in each prompt's opening), so dialogues last from a couple of
turns to `--turns`, by quality and by the persona of the sampled user. Its answers are memoised by context
(every run meets the same contexts; a warm-up run fills the memo), and each `generate_sequences` call takes what
a decoding engine's call would: `--call-ms` per call (dispatch, prefill) plus, per decoding step (the batch's
longest response, in tokens), `--step-ms` + `--step-row-us` per row. Sync and async runs alternate, `--repeats`
times each, on the same seeded batch; the simulator seeds depend on the dialogue and turn only, so both modes run
the same dialogues (checked: same outcomes in every run).

Printed and written: per mode the median wall time (time to the last dialogue), generation and simulator busy
fractions, p50/p95 dialogue time and generation batches; `async_over_sync_wall` is the ratio of the medians.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer

from bench.rollout_loop import GROUP_SIZE, SCENARIO
from bench.results import write_result
from bench.user_sim_dispatch import latency_flags
from llm_agent.generation import LLMGenerationManager
from llm_agent.rollout.dialogue_record import records_from_batch
from llm_agent.scenario import load_scenario
from llm_agent.stand_ins.scripted_policy import ScriptedPolicyWorkerGroup
from llm_agent.user_sim.processes import SimulatorGroup
from utils.make_tiny_model import build_tiny_model
from verl.protocol import DataProto
from verl.utils.torch_functional import compute_position_id_with_mask
from verl.workers.rollout.engine import RolloutEngine
from verl.workers.rollout.hf_rollout import generation_tensors

logger = logging.getLogger("bench.async_rollout")

REPO = Path(__file__).resolve().parents[1]
QUALITIES = ("good", "evasive", "bad")
_GROUP = re.compile(r"\(call (\d+)\)")


class CostedPolicy(RolloutEngine):
    """Scripted agents of mixed quality, memoised by context, taking a decoding engine's time per call."""

    world_size = 2

    def __init__(self, tokenizer: Any, scenario: Any, call_ms: float, step_ms: float, step_row_us: float):
        self.tokenizer = tokenizer
        self.agents = {q: ScriptedPolicyWorkerGroup(tokenizer, scenario, world_size=1, quality=q) for q in QUALITIES}
        self.memo: dict[bytes, list[int]] = {}
        self.misses = 0
        self.call_s, self.step_s, self.step_row_s = call_ms / 1e3, step_ms / 1e3, step_row_us / 1e6

    def _answer(self, prompts: DataProto, i: int, context: torch.Tensor) -> list[int]:
        """The scripted agent's response ids to row `i` (memoised by its context ids)."""
        key = context.numpy().tobytes()
        if key not in self.memo:
            self.misses += 1
            row = prompts[i:i + 1]
            group = int(_GROUP.search(self.tokenizer.decode(context.tolist())).group(1))
            out = self.agents[QUALITIES[group % len(QUALITIES)]].generate_sequences(row)
            self.memo[key] = out.batch["responses"][0][out.batch["response_mask"][0].bool()].tolist()
        return self.memo[key]

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Answer every row, after sleeping for the modelled cost of this batch."""
        started = time.perf_counter()
        ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
        answers = [self._answer(prompts, i, ids[i][mask[i].bool()]) for i in range(len(ids))]
        length = int(prompts.meta_info["response_length"])
        pad = int(prompts.meta_info["pad_token_id"])
        responses = torch.tensor([(a + [pad] * length)[:length] for a in answers], dtype=ids.dtype)
        tensors = generation_tensors(ids, mask, prompts.batch["position_ids"], responses,
                                     [int(prompts.meta_info["eos_token_id"])], pad)
        steps = int(tensors["response_mask"].sum(dim=1).max())
        cost = self.call_s + steps * (self.step_s + self.step_row_s * len(ids))
        time.sleep(max(0.0, cost - (time.perf_counter() - started)))
        return self.versioned(DataProto.from_dict(tensors=tensors))


def grouped_batch(tokenizer: Any, scenario: Any, dialogues: int) -> DataProto:
    """The generation batch: `GROUP_SIZE` rows per uid, the group's number in its opening message."""
    rows = []
    for i in range(dialogues):
        messages = [{"role": "system", "content": scenario.render_agent_prompt()},
                    {"role": "user", "content": f"{scenario.agent_opening} (call {i // GROUP_SIZE})"}]
        rows.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    enc = tokenizer(rows, return_tensors="pt", padding=True, add_special_tokens=False)
    uids = np.empty(dialogues, dtype=object)
    uids[:] = [f"p{i // GROUP_SIZE}" for i in range(dialogues)]
    tensors = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
               "position_ids": compute_position_id_with_mask(enc["attention_mask"])}
    return DataProto.from_dict(tensors, non_tensors={"uid": uids})


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of this process (`pid` None) or of process `pid` (from /proc)."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_run(mode: str, policy: CostedPolicy, scenario: Any, urls: list[str], args: argparse.Namespace,
            server_pids: list[int]) -> dict:
    """One rollout of `args.dialogues` dialogues in `mode`; returns its pacing metrics, outcome counts and the
    CPU time the driver and the simulator servers spent on it."""
    tokenizer = policy.tokenizer
    cpu_before = [cpu_seconds()] + [cpu_seconds(pid) for pid in server_pids]
    config = {"scenario": str(SCENARIO), "mode": mode, "async_rollout": {"batch_wait_ms": args.batch_wait_ms},
              "max_turns": args.turns, "max_tokens_per_turn": 256,
              "max_response_length": 320 * args.turns, "cache": {"enabled": False},
              "controller": {"enabled": True, "seed": 0}, "seed": 0,
              "user_sim": {"urls": urls, "timeout_s": 30.0, "max_attempts": 3, "check_at_start": False}}
    loop = LLMGenerationManager(tokenizer, policy, config, is_validation=False)
    try:
        misses = policy.misses
        out = loop.run_llm_loop(grouped_batch(tokenizer, scenario, args.dialogues))
        sim_stats = {k.removeprefix("user_sim/"): v for k, v in loop.client.stats().items()
                     if k.endswith(("/requests", "latency_p50_s", "latency_p95_s"))}
    finally:
        loop.close()
    m = out.meta_info["metrics"]
    records = records_from_batch(out)
    outcomes = [r.outcome for r in records]
    turns = [r.num_turns for r in records]
    return {"mode": mode, "wall_s": m["rollout/time_to_last_dialogue_s"],
            "generate_busy": m["rollout/generate_busy_fraction"], "user_sim_busy": m["rollout/user_sim_busy_fraction"],
            "dialogue_p50_s": m["rollout/dialogue_time_p50_s"], "dialogue_p95_s": m["rollout/dialogue_time_p95_s"],
            "generate_batches": int(m["rollout/generate_batches"]), "sim_requests": int(m["rollout/sim_requests"]),
            "outcomes": {o: outcomes.count(o) for o in sorted(set(outcomes))},
            "turns_min_mean_max": [min(turns), statistics.mean(turns), max(turns)],
            "memo_misses": policy.misses - misses, "user_sim": sim_stats,
            "cpu_s": {"driver": cpu_seconds() - cpu_before[0],
                      "simulators": sum(cpu_seconds(pid) for pid in server_pids) - sum(cpu_before[1:])}}


def median_row(runs: list[dict]) -> dict:
    """Per-key medians of one mode's runs (outcomes from the first run)."""
    keys = ("wall_s", "generate_busy", "user_sim_busy", "dialogue_p50_s", "dialogue_p95_s", "generate_batches")
    return {"mode": runs[0]["mode"], **{k: statistics.median(r[k] for r in runs) for k in keys},
            "outcomes": runs[0]["outcomes"], "turns_min_mean_max": runs[0]["turns_min_mean_max"]}


def main(argv: list[str] | None = None) -> dict:
    """Start the simulators, alternate sync and async runs, print the table and write the JSON results."""
    load_at_start = os.getloadavg()[0]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dialogues", type=int, default=480)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--median-ms", type=float, default=50.0)
    p.add_argument("--sigma", type=float, default=0.6)
    p.add_argument("--slow-factor", type=float, default=5.0)
    p.add_argument("--batch-wait-ms", type=float, default=5.0, help="rollout_loop.config.async_rollout.batch_wait_ms")
    p.add_argument("--call-ms", type=float, default=20.0)
    p.add_argument("--step-ms", type=float, default=0.3)
    p.add_argument("--step-row-us", type=float, default=4.0)
    p.add_argument("--out", type=Path, default=REPO / "bench/results/async_rollout.json")
    args = p.parse_args(argv)
    if args.dialogues % GROUP_SIZE:
        p.error(f"--dialogues must be a multiple of {GROUP_SIZE} (rows per uid)")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    scenario = load_scenario(SCENARIO)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(Path(tmp) / "tiny", seed=0), padding_side="left")
        # one base seed for both, as for two replicas of one simulator: a reply depends on the request only
        with SimulatorGroup(Path(tmp)) as sims:
            urls = [sims.start(*latency_flags(args.median_ms, args.sigma, 1)),
                    sims.start(*latency_flags(args.median_ms * args.slow_factor, args.sigma, 1))]
            sims.wait_ready(*urls, timeout_s=90)
            policy = CostedPolicy(tokenizer, scenario, args.call_ms, args.step_ms, args.step_row_us)
            pids = [sims.procs[url].pid for url in urls]
            warm_up = one_run("sync", policy, scenario, urls, args, pids)  # fills the memo
            logger.warning("warm-up: %d agent turns computed", warm_up["memo_misses"])
            runs: dict[str, list[dict]] = {"sync": [], "async": []}
            for repeat in range(args.repeats):
                for mode in ("sync", "async"):
                    runs[mode].append(one_run(mode, policy, scenario, urls, args, pids))
                    logger.warning("repeat %d %s: %.2fs", repeat, mode, runs[mode][-1]["wall_s"])
    same = all(r["outcomes"] == warm_up["outcomes"] and r["memo_misses"] == 0 for r in runs["sync"] + runs["async"])
    rows = [median_row(runs["sync"]), median_row(runs["async"])]
    summary = {"async_over_sync_wall": rows[1]["wall_s"] / rows[0]["wall_s"], "same_outcomes_every_run": same,
               "goal_at_most": 0.6}
    result = write_result(args, load_at_start, runs=runs, median=rows, summary=summary)
    lines = [f"{'mode':>5} {'wall s':>7} {'gen busy':>9} {'sim busy':>9} {'p50 s':>6} {'p95 s':>6} {'batches':>8}"
             f"   median of {args.repeats}; {args.dialogues} dialogues, <= {args.turns} turns"]
    for r in rows:
        lines.append(f"{r['mode']:>5} {r['wall_s']:7.2f} {r['generate_busy']:9.2f} {r['user_sim_busy']:9.2f} "
                     f"{r['dialogue_p50_s']:6.2f} {r['dialogue_p95_s']:6.2f} {r['generate_batches']:8.0f}")
    lines.append(f"outcomes {rows[0]['outcomes']}, turns min/mean/max {rows[0]['turns_min_mean_max']}, "
                 f"same in every run (no memo miss): {same}")
    lines.append(f"async_over_sync_wall: {summary['async_over_sync_wall']:.3f} (goal <= 0.6)")
    lines.append(f"written to {args.out}")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
