"""Benchmark: synchronous vs one-step-off vs staleness-2 training (issue 37) with a latency-bound simulator.

    python -m bench.off_policy [--steps 4] [--prompts 4] [--group 4] [--max-turns 4] [--median-ms 300]
                               [--sigma 1.0] [--loop-mode async] [--ppo-epochs 1] [--repeats 2]
                               [--modes sync,one_step_off,staleness_2,staleness_2_in_flight_2,one_step_off_split,
                                        staleness_2_in_flight_2_split]
                               [--out bench/results/off_policy.json]

The real trainer (Ray, 2 FSDP CPU workers, the HF rollout) trains a small Qwen2 model, warm-started on scripted
calls so that its turns reach the simulator (the test suite's warm model: 160 SFT steps, made once under
outputs/off_policy_bench/), against two scripted simulator servers on loopback with injected lognormal latency
(median `--median-ms`, log-sigma `--sigma`: heavy-tailed). Every mode runs the same prompts, seeds and decoupled-PPO
correction (`rollout_is=token`), alternating `--repeats` times: `async_training.staleness_threshold` 0 (sync), 1
(one-step-off) and 2 with `partial_rollout=true` (up to 2 rollouts queued ahead), run one after another
(`staleness_2`) or both at once (`staleness_2_in_flight_2`: `rollouts_in_flight=2`); the `*_split` modes run the
rollout on 2 CPU processes of its own (split placement: `actor_rollout_ref.rollout.n_gpus_per_node=2`), given the
actor's weights after each update, so no generation waits for a training call. The table shows each figure's
median over a mode's runs; the JSON also holds every run.

Per mode: the fit's wall time, the median step time over steps 2.. (step 1 has nothing to overlap in either mode),
and the idle fractions over the steps' wall time: the trainer's (waiting for a rollout: sync, the rollout's own
generation and reward time; off-policy modes, `async/trainer_idle_s`), the rollout side's (no rollout running: sync,
the step's training time; off-policy modes, `async/rollout_idle_s`) and the simulators' (no request in flight:
1 - `rollout/time_user_sim_s` / step time), with the staleness of the trained tokens and the dialogues dropped as
over-stale; and the sums over the
steps of the rollouts' own time (generation and reward), of the training time (step time less the trainer's
wait) and what the overlap hid (their sum less the steps' time: 0 in sync mode, at most the smaller of the two).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from bench.results import write_result
from bench.user_sim_dispatch import latency_flags
from llm_agent.scenario import DEFAULT_SCENARIO_PATH, load_scenario
from llm_agent.user_sim.processes import ServerSpec, SimulatorGroup

logger = logging.getLogger("bench.off_policy")

REPO = Path(__file__).resolve().parents[1]
SCENARIO = DEFAULT_SCENARIO_PATH
WORK = REPO / "outputs" / "off_policy_bench"
# mode -> (async_training.staleness_threshold, rollouts_in_flight, the rollout's own processes: 0 = on the actor's)
MODES = {"sync": (0, 1, 0), "one_step_off": (1, 1, 0), "staleness_2": (2, 1, 0), "staleness_2_in_flight_2": (2, 2, 0),
         "one_step_off_split": (1, 1, 2), "staleness_2_in_flight_2_split": (2, 2, 2)}
WARM_RECIPE = {"dialogues": 32, "max_turns": 4, "steps": 160, "lr": 1e-2, "batch_size": 8, "seed": 0}


def warm_model(work: Path) -> Path:
    """The tiny model warm-started on scripted calls (made once under `work`, reused when complete)."""
    from utils.make_tiny_model import build_tiny_model
    from utils.sft_warm_start import scripted_dialogues, sft_on_dialogues

    out, done = work / "warm_model", work / "warm_model" / "DONE"
    if done.exists():
        return out
    prompt = load_scenario(SCENARIO).agent_compact_prompt
    tiny = build_tiny_model(work / "tiny_model", 0)
    r = WARM_RECIPE
    dialogues = scripted_dialogues(str(SCENARIO), r["dialogues"], {"good": 1.0}, seed=r["seed"],
                                   max_turns=r["max_turns"], system_prompt=prompt)
    sft_on_dialogues(tiny, out, dialogues, steps=r["steps"], lr=r["lr"], batch_size=r["batch_size"], seed=r["seed"])
    done.write_text(json.dumps(r))
    return out


def overrides(args: argparse.Namespace, model: Path, data: dict[str, Path], run: Path, urls: list[str],
              staleness: int, in_flight: int, rollout_devices: int) -> list[str]:
    """The sead_trainer overrides of one mode's run."""
    loop = "rollout_loop.config"
    return [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={data['train']}",
        f"data.val_files={data['test']}", "data.max_prompt_length=96",
        "data.max_response_length=512", f"data.train_batch_size={args.prompts}", "data.seed=0",
        f"actor_rollout_ref.rollout.n={args.group}", f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        f"actor_rollout_ref.actor.ppo_epochs={args.ppo_epochs}", "actor_rollout_ref.rollout.calculate_log_probs=true", "algorithm.rollout_correction.rollout_is=token",
        f"async_training.staleness_threshold={staleness}",
        f"async_training.partial_rollout={'true' if staleness >= 2 else 'false'}",
        f"async_training.rollouts_in_flight={in_flight}",
        f"actor_rollout_ref.rollout.n_gpus_per_node={rollout_devices}",
        f"trainer.total_training_steps={args.steps}", "trainer.n_gpus_per_node=2", "trainer.device=cpu",
        "trainer.logger=[jsonl]", f"trainer.default_local_dir={run / 'ckpt'}", f"trainer.log_dir={run / 'logs'}",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.resume_mode=disable",
        f"{loop}.scenario={SCENARIO}", f"{loop}.mode={args.loop_mode}", f"{loop}.max_turns={args.max_turns}",
        f"{loop}.max_tokens_per_turn=64", f"{loop}.max_user_tokens=48", f"{loop}.user_sim.urls='{','.join(urls)}'",
        f"{loop}.user_sim.timeout_s=60", f"{loop}.cache.enabled=false",
    ]


def run_mode(args: argparse.Namespace, model: Path, data: dict[str, Path], mode: str) -> dict[str, Any]:
    """Train `args.steps` steps in `mode` against fresh latency-injected simulators; the per-step metrics and the
    fit's wall time."""
    from verl.single_controller.ray import RayResourcePool
    from verl.trainer.config_schema import compose_config
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, Role
    from verl.utils.dataset import load_tokenizer
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    run = args.work / mode
    shutil.rmtree(run, ignore_errors=True)  # a fresh log and checkpoint directory per run
    with contextlib.ExitStack() as stack:
        sims = stack.enter_context(SimulatorGroup(run / "sims", ServerSpec(scenario=str(SCENARIO), log_level="warning")))
        urls = [sims.start(*latency_flags(args.median_ms, args.sigma, seed)) for seed in (1, 2)]
        sims.wait_ready(*urls)
        config = compose_config(overrides(args, model, data, run, urls, *MODES[mode]), config_name="sead_trainer")
        pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
        trainer = RayPPOTrainer(config, load_tokenizer(str(model)), {Role.ActorRollout: ActorRolloutRefWorker}, pool)
        try:
            trainer.init_workers()
            started = time.monotonic()
            trainer.fit()
            wall = time.monotonic() - started
        finally:
            trainer.shutdown()
            pool.remove()
    steps = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    return {"wall_s": wall, "steps": steps}


def summary(mode: str, run: dict[str, Any]) -> dict[str, float]:
    """The mode's wall times, idle fractions and staleness (see the module docstring)."""
    steps = run["steps"]
    step_s = [s["timing_s/step"] for s in steps]
    rollout_s = [s.get("timing_s/gen", 0.0) + s.get("timing_s/reward", 0.0) for s in steps]
    if mode == "sync":
        trainer_idle, rollout_idle = rollout_s, [t - r for t, r in zip(step_s, rollout_s)]
    else:
        trainer_idle = [s["async/trainer_idle_s"] for s in steps]
        rollout_idle = [s["async/rollout_idle_s"] for s in steps]
    total = sum(step_s)
    train_s = sum(t - i for t, i in zip(step_s, trainer_idle))
    sim_busy = sum(s.get("rollout/time_user_sim_s", 0.0) for s in steps)
    out = {"wall_s": run["wall_s"], "step_s_median_after_1": statistics.median(step_s[1:] or step_s),
           "steps_s": total, "rollout_s": sum(rollout_s), "train_s": train_s,
           "hidden_s": sum(rollout_s) + train_s - total,
           "trainer_idle_frac": sum(trainer_idle) / total, "rollout_idle_frac": sum(rollout_idle) / total,
           "simulator_idle_frac": max(0.0, 1.0 - sim_busy / total),
           "completion_rate": statistics.mean(s.get("dialogue/completion_rate", 0.0) for s in steps)}
    stale = [s for s in steps if "async/staleness_mean" in s]
    if stale:
        out["tokens_stale_frac"] = statistics.mean(s["async/tokens_stale_frac"] for s in stale)
        out["staleness_max"] = max(s["async/staleness_max"] for s in stale)
        out["dialogues_mixed_versions_frac"] = statistics.mean(s["async/dialogues_mixed_versions_frac"] for s in stale)
        out["dropped_stale_dialogues"] = sum(s.get("async/dropped_stale_dialogues", 0.0) for s in stale)
    return out


def print_table(summaries: dict[str, dict[str, float]]) -> None:
    """One row per mode."""
    cols = ("wall_s", "step_s_median_after_1", "rollout_s", "train_s", "hidden_s", "trainer_idle_frac",
            "rollout_idle_frac", "simulator_idle_frac", "tokens_stale_frac", "staleness_max", "dropped_stale_dialogues")
    print(f"{'mode':<24}" + "".join(f"{c:>25}" for c in cols))
    for mode, s in summaries.items():
        print(f"{mode:<24}" + "".join(f"{s[c]:>25.3f}" if c in s else f"{'-':>25}" for c in cols))
    sync = summaries.get("sync")
    for mode, off in summaries.items():
        if sync and mode != "sync":
            print(f"{mode} / sync: wall {off['wall_s'] / sync['wall_s']:.3f}, median step after step 1 "
                  f"{off['step_s_median_after_1'] / sync['step_s_median_after_1']:.3f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--median-ms", type=float, default=300.0)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--loop-mode", choices=("sync", "async"), default="async")
    p.add_argument("--ppo-epochs", type=int, default=1, help="passes of the update over the batch (training time)")
    p.add_argument("--repeats", type=int, default=2, help="runs per mode, alternating; the table shows medians")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--work", type=Path, default=WORK)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "off_policy.json")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    if unknown := sorted(set(modes) - set(MODES)):
        p.error(f"unknown --modes {unknown}; choose from {list(MODES)}")
    logging.basicConfig(level=logging.WARNING)
    import ray

    from utils.create_prompt_data import create_prompt_data

    load_at_start = os.getloadavg()[0]
    args.work.mkdir(parents=True, exist_ok=True)
    model = warm_model(args.work)
    data = create_prompt_data(SCENARIO, args.work / "data", 64, 4, seed=0,
                              system_prompt=load_scenario(SCENARIO).agent_compact_prompt)
    ray.init(address="local", num_cpus=8, include_dashboard=False)
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    try:
        for _ in range(args.repeats):  # the modes alternate, so a change in the box's load hits both
            for mode in modes:
                runs[mode].append(run_mode(args, model, data, mode))
    finally:
        ray.shutdown()
    per_run = {mode: [summary(mode, run) for run in mode_runs] for mode, mode_runs in runs.items()}
    summaries = {mode: {key: statistics.median(s[key] for s in rows) for key in rows[0]}
                 for mode, rows in per_run.items()}
    print_table(summaries)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args, load_at_start, summaries=summaries, per_run=per_run,
                 steps={mode: [run["steps"] for run in mode_runs] for mode, mode_runs in runs.items()})


if __name__ == "__main__":
    main()
