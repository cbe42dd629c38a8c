"""Benchmark: trajectory GRPO against each turn-level credit option on the learning benchmark, paired by profile.

    python -m bench.turn_credit_learning --warm-model WORK/warm_model [--seeds 0,1,2] [--options grpo,turn_mixed,...]
                                         [--steps 12] [--test-freq 2] [--reference grpo]
                                         [--work-dir outputs/bench_turn_credit]
                                         [--out bench/results/turn_credit_learning.json] [--table-only]

Every run is `python -m bench.learning` (its own process: Ray, 2 FSDP workers, 2 scripted simulators) from the
SAME warm-started model (`--warm-model`, e.g. the `warm_model` of an earlier `bench.learning` run), so the options
differ only in how credit is assigned. A seed fixes the trainer, data, controller, simulators and the fixed test
profiles, so the runs of one seed validate on the same users and pair up by profile. The options
(docs/turn_level_credit.md; the per-turn signals and labels come from llm_agent/diagnosis):

- `grpo`: trajectory GRPO with the completion-only reward (the reference);
- `turn_mixed`: `adv_estimator=turn_mixed`, `turn_mixed.turn_weight` = `--turn-weight`, per-turn reward
  `reward.kwargs.turn_weights.state_change=1` (the user-state change each turn caused);
- `turn_gae`: `adv_estimator=turn_gae` (gamma 1, lam 1, a critic from the warm model with a fresh value head,
  lr `--critic-lr`) with the same per-turn reward added to the outcome;
- `diagnosis`: GRPO plus `algorithm.diagnosis_reweight` weighting every failure label of the scenario by
  `--label-weight`, `apply_to=negative` (the labelled turns of failed calls are pushed down harder);
- `diagnosis_all`: the same weights with `apply_to=all` (a labelled turn's positive advantage is scaled too;
  with the completion-only reward a labelled (failed) call never has one, so this is `diagnosis` exactly);
- `mixed_diagnosis`, `mixed_diagnosis_all`: `turn_mixed` with the reweighting (`negative`, `all`): the turn term
  can give a failed call's turn a positive advantage, which only `all` scales.

Per run: the validation CR curve, the first validation step with CR >= `--target` (None when never) and the CR
at `--at-step`; per option and seed, the calls paired with GRPO's at `--at-step` (gained, lost, two-sided exact
sign test), or with the `--reference` option's. A run whose result file exists is not run again (delete it to
rerun); `--table-only` only tabulates.
Writes `--out` (JSON) and prints the side-by-side table.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.learning_stats import sign_test_one_sided, val_outcomes
from bench.results import write_result

REPO = Path(__file__).resolve().parents[1]
OPTIONS = ("grpo", "turn_mixed", "turn_gae", "diagnosis", "diagnosis_all", "mixed_diagnosis",
           "mixed_diagnosis_all")
LABELS = ("doubt_unanswered", "false_claim", "premature_push", "hang_up_after_drop", "format_error", "timeout_loop",
          "truncated")
logger = logging.getLogger("bench.turn_credit_learning")


def option_args(option: str, args: argparse.Namespace) -> list[str]:
    """The bench.learning arguments of one option (module docstring)."""
    if option == "grpo":
        return []
    if option == "turn_mixed":
        return ["--adv-estimator", "turn_mixed", "--turn-weight", str(args.turn_weight),
                "--turn-weights", "state_change=1.0"]
    if option == "turn_gae":
        return ["--adv-estimator", "turn_gae", "--critic-lr", str(args.critic_lr), "--turn-weights", "state_change=1.0"]
    if option in ("diagnosis", "diagnosis_all"):
        return ["--diagnosis-weights", ",".join(f"{label}={args.label_weight}" for label in LABELS),
                "--diagnosis-apply-to", "all" if option.endswith("_all") else "negative"]
    if option in ("mixed_diagnosis", "mixed_diagnosis_all"):
        return option_args("turn_mixed", args) + option_args(option.replace("mixed_", ""), args)
    raise ValueError(f"unknown option {option!r} (one of {OPTIONS})")


def run_command(option: str, seed: int, args: argparse.Namespace) -> tuple[list[str], Path, Path]:
    """(command, work directory, result file) of one run."""
    work = args.work_dir / f"{option}_s{seed}"
    out = args.work_dir / f"{option}_s{seed}.json"
    command = [sys.executable, "-m", "bench.learning", "--seed", str(seed), "--steps", str(args.steps),
               "--test-freq", str(args.test_freq), "--warm-model", str(args.warm_model), "--work-dir", str(work),
               "--out", str(out), *option_args(option, args)]
    return command, work, out


def first_step_at(curve: list[dict[str, Any]], target: float) -> int | None:
    """The first validation step whose CR is at least `target`, None when none is."""
    return next((v["step"] for v in curve if v["completion_rate"] >= target), None)


def summarise(option: str, seed: int, record: dict[str, Any], work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One run's row: its curve, steps to the target CR, CR at the chosen step, wall time."""
    curve = record["val_curve"]
    at = {v["step"]: v["completion_rate"] for v in curve}.get(args.at_step)
    return {"option": option, "seed": seed, "val_curve": [(v["step"], v["completion_rate"]) for v in curve],
            "steps_to_target": first_step_at(curve, args.target), "cr_at_step": at,
            "grpo_wall_s": record["wall_s"]["grpo"], "rollouts": str(work / "rollouts.jsonl")}


def paired_with_reference(row: dict[str, Any], reference: dict[str, Any], step: int) -> dict[str, Any] | None:
    """The validation calls of `row` and `reference` at `step`, paired by profile: gained / lost by the option
    and the two-sided exact sign test; None when either run has no validation there."""
    def outcomes(path: str) -> dict[str, bool]:
        lines = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
        return val_outcomes(lines, step)

    ours, theirs = outcomes(row["rollouts"]), outcomes(reference["rollouts"])
    if not ours or set(ours) != set(theirs):
        return None
    gained = sum(ours[k] and not theirs[k] for k in ours)
    lost = sum(theirs[k] and not ours[k] for k in ours)
    p = min(1.0, 2 * min(sign_test_one_sided(gained, lost), sign_test_one_sided(lost, gained)))
    return {"n": len(ours), "gained": gained, "lost": lost, "p_two_sided": p}


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """The side-by-side table: per seed and option, steps to the target CR, CR at the step, pairing with the
    reference option."""
    ref = args.reference
    print(f"\nValidation CR (greedy, fixed test profiles of the seed); steps to CR >= {args.target} (validation every "
          f"{args.test_freq} steps, '>{args.steps}' = not reached); CR at step {args.at_step}; paired with {ref} at "
          f"step {args.at_step} (gained/lost, two-sided exact sign test)")
    width = max([len("option")] + [len(row["option"]) for row in rows])
    target, at = f"steps to {args.target}", f"CR@{args.at_step}"
    print(f"{'seed':>4} | {'option':>{width}} | {target:>12} | {at:>6} | {'vs ' + ref:>16} | curve")
    for row in rows:
        steps = row["steps_to_target"]
        paired = row.get("paired_with_reference")
        vs = f"+{paired['gained']}/-{paired['lost']} p={paired['p_two_sided']:.2g}" if paired else ""
        cr = f"{row['cr_at_step']:.3f}" if row["cr_at_step"] is not None else "-"
        curve = " ".join(f"{s}:{cr_:.2f}" for s, cr_ in row["val_curve"])
        reached = steps if steps is not None else f">{args.steps}"
        print(f"{row['seed']:>4} | {row['option']:>{width}} | {reached:>12} | {cr:>6} | {vs:>16} | {curve}")


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warm-model", type=Path, required=True, help="the warm-started model every run trains")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--options", default=",".join(OPTIONS))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--test-freq", type=int, default=2)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--at-step", type=int, default=8)
    parser.add_argument("--turn-weight", type=float, default=0.5)
    parser.add_argument("--critic-lr", type=float, default=1e-3)
    parser.add_argument("--label-weight", type=float, default=1.5)
    parser.add_argument("--reference", default="grpo", choices=OPTIONS, help="the option every other is paired with")
    parser.add_argument("--work-dir", type=Path, default=REPO / "outputs/bench_turn_credit")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/turn_credit_learning.json")
    parser.add_argument("--table-only", action="store_true", help="tabulate the existing run results only")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    seeds = [int(s) for s in args.seeds.split(",")]
    options = [o for o in args.options.split(",")]
    for option in options:
        option_args(option, args)  # an unknown option fails before any run
    load_at_start = os.getloadavg()[0]
    args.work_dir.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows, commands = [], {}
    for seed in seeds:
        for option in options:
            command, work, out = run_command(option, seed, args)
            commands[f"{option}_s{seed}"] = " ".join(command[1:])
            if not out.exists() and not args.table_only:
                logger.info("run %s seed %d: %s", option, seed, " ".join(command[1:]))
                started = time.monotonic()
                with open(args.work_dir / f"{option}_s{seed}.log", "w", encoding="utf-8") as log:
                    subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=True)
                logger.info("run %s seed %d done in %.0f s", option, seed, time.monotonic() - started)
            if out.exists():
                rows.append(summarise(option, seed, json.loads(out.read_text(encoding="utf-8")), work, args))
    by_key = {(r["option"], r["seed"]): r for r in rows}
    for row in rows:
        reference = by_key.get((args.reference, row["seed"]))
        if reference is not None and row["option"] != args.reference:
            row["paired_with_reference"] = paired_with_reference(row, reference, args.at_step)
    write_result(args, load_at_start, rows=rows, commands=commands)
    print_table(rows, args)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
