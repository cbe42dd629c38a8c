"""Iterated training, as in the original SEAD: train, analyse the mistakes, write the next profiles, continue.

    python -m utils.iterate --iterations 5 --steps-per-iteration 10 --root outputs/iterations/EXP \\
        --ckpt-dir outputs/checkpoints/EXP --scenario SCENARIO.yaml --train-samples 600 \\
        [--profiles 1000] [--llm-url URL] [--sim-restart-command CMD] [--dry-run] -- TRAINER COMMAND ...

scripts/main.sh and scripts/2ins_main.sh call it with ITERATIONS=N > 1. Iteration k (1..N) lives in
ROOT/iter_0k/: `profiles.jsonl` (its pool of profiles, written ahead: uniform weights for the first, the previous
iteration's mistakes analysis for the others; utils/generate_profiles.py with --llm-url, else the rule table),
`prompt_data/train.parquet` (those profiles as prompt rows), `rollouts.jsonl` and `val_metrics.jsonl` (its
dialogues), `mistakes.json` (the analysis of its training dialogues) and `done.json`. It runs the trainer command
with `trainer.total_training_steps=k*S`, the controller drawing from that pool (`profile_source=pool`) and the
shared checkpoint directory, so it continues from the last checkpoint (model, optimizer, controller weights).
Each phase leaves a marker, so a rerun of the same command skips what is done and resumes an interrupted
iteration from its last checkpoint (its logs cut back to that step first): no iteration is trained twice. The
warm-up is fixed over all N*S steps. Simulators are not restarted unless --sim-restart-command is given (run before every iteration after the
first; its last output line is the new comma-separated URL list).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from llm_agent.evaluation.analysis import analyze_by_split
from llm_agent.evaluation.run_data import read_dialogues
from llm_agent.profiles.pool import read_profile_file
from llm_agent.profiles.rules import load_rule_table
from llm_agent.profiles.sources import ChatEndpoint, load_weights
from llm_agent.profiles.writer import ProfileWriter, WriterSettings
from llm_agent.scenario import load_scenario
from utils.create_prompt_data import TRAIN_FILE, prompt_rows, write_rows
from verl.utils.checkpoint import find_latest_checkpoint

logger = logging.getLogger("iterate")

CONTROLLER = "rollout_loop.config.controller."
URLS_KEY = "rollout_loop.config.user_sim.urls"
OWN_CONTROLLER_KEYS = ("enabled", "profile_source", "pool_path", "rules_path")


def override_value(cmd: list[str], key: str) -> str | None:
    """The value of the last `key=value` argument of a trainer command, or None."""
    values = [a.split("=", 1)[1] for a in cmd if a.startswith(key + "=")]
    return values[-1] if values else None


def with_overrides(cmd: list[str], overrides: dict[str, Any]) -> list[str]:
    """The command without its arguments for the keys of `overrides`, followed by `overrides` as key=value."""
    kept = [a for a in cmd if a.split("=", 1)[0].lstrip("+") not in overrides]
    return kept + [f"{k}={v}" for k, v in overrides.items()]


def trim_to_step(path: Path, last_step: int) -> int:
    """Drop the lines of a JSONL log whose "step" is after `last_step` (and a torn last line): what a killed
    trainer logged after its last checkpoint, which the resumed one logs again. Returns the lines dropped."""
    if not path.is_file():
        return 0
    lines = path.read_text(encoding="utf-8").split("\n")
    kept = []
    for line in lines:
        try:
            row = json.loads(line) if line.strip() else None
        except ValueError:  # only a torn last line can fail: every other line was written whole
            continue
        if row is not None and not (isinstance(row.get("step"), int) and row["step"] > last_step):
            kept.append(line)
    dropped = sum(1 for line in lines if line.strip()) - len(kept)
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        tmp.replace(path)
    return dropped


def checkpoint_step(ckpt_dir: Path) -> int:
    """The global step of the checkpoint the trainer would resume from (0: none)."""
    path = find_latest_checkpoint(ckpt_dir)
    return int(path.name.rsplit("_", 1)[1]) if path is not None else 0


class IterationDriver:
    """Runs the iterations of the module docstring for one experiment."""

    def __init__(self, args: argparse.Namespace, train_cmd: list[str]) -> None:
        self.args, self.cmd = args, list(train_cmd)
        self.root, self.ckpt_dir = Path(args.root), Path(args.ckpt_dir)
        self.scenario = load_scenario(args.scenario)
        self.rules = load_rule_table(args.rules)
        self.total = args.iterations * args.steps_per_iteration
        save_freq = override_value(self.cmd, "trainer.save_freq")
        if save_freq is not None and int(save_freq) <= 0:
            raise ValueError(f"trainer.save_freq={save_freq}: iterations continue from the last checkpoint, so the "
                             "trainer must save (any save_freq > 0 saves the last step of every iteration)")
        self.controller = {a.split("=", 1)[0][len(CONTROLLER):]: yaml.safe_load(a.split("=", 1)[1])
                           for a in self.cmd if a.startswith(CONTROLLER)}
        if self.controller.get("enabled") is False:
            raise ValueError(f"{CONTROLLER}enabled=false: iterations draw training users from the profile pools "
                             "through the state controller; leave it enabled")

    def iter_dir(self, k: int) -> Path:
        """ROOT/iter_0k."""
        return self.root / f"iter_{k:02d}"

    def overrides(self, k: int) -> dict[str, Any]:
        """The trainer overrides of iteration k."""
        d = self.iter_dir(k)
        out: dict[str, Any] = {
            "data.train_files": d / "prompt_data" / TRAIN_FILE,
            "trainer.total_training_steps": k * self.args.steps_per_iteration,
            CONTROLLER + "profile_source": "pool", CONTROLLER + "pool_path": d / "profiles.jsonl",
            "rollout_loop.config.rollout_log_path": d / "rollouts.jsonl",
            "rollout_loop.config.val_metrics_path": d / "val_metrics.jsonl",
        }
        ratio = override_value(self.cmd, "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio")
        if ratio is not None and float(ratio) > 0:  # warm up once, over the whole run, not per iteration
            out["actor_rollout_ref.actor.optim.lr_warmup_steps"] = max(1, int(float(ratio) * self.total))
        return {k: str(v) for k, v in out.items()}

    # ------------------------------------------------------------------------------------------ phases
    def write_profiles(self, k: int) -> None:
        """ROOT/iter_0k/profiles.jsonl and its prompt rows (resumed by the writer when interrupted)."""
        d = self.iter_dir(k)
        if (d / "profiles.done").is_file():
            return
        d.mkdir(parents=True, exist_ok=True)
        weights = load_weights(self.iter_dir(k - 1) / "mistakes.json", "train") if k > 1 else None
        a = self.args
        n = a.profiles
        key = os.environ.get("PROFILE_LLM_API_KEY") or os.environ.get("OPENAI_API_KEY")
        endpoint = ChatEndpoint(a.llm_url, a.llm_model, key, timeout_s=a.llm_timeout) if a.llm_url else None
        settings = WriterSettings(n=n, seed=a.seed + k, min_behaviors=self.controller.get("min_behaviors", 1),
                                  max_behaviors=self.controller.get("max_behaviors", 3),
                                  allow_extremes=bool(self.controller.get("allow_extremes", False)))
        try:
            stats = ProfileWriter(self.scenario, d / "profiles.jsonl", settings, self.rules, weights, endpoint).run()
        finally:
            if endpoint is not None:
                endpoint.close()
        pool = read_profile_file(d / "profiles.jsonl", self.scenario)
        profiles = [pool[i % len(pool)] for i in range(a.train_samples)]  # the column the controller-off path reads
        write_rows(prompt_rows(self.scenario, profiles, "train", a.system_prompt), d / "prompt_data" / TRAIN_FILE)
        (d / "profiles.done").write_text(json.dumps(stats, indent=1) + "\n", encoding="utf-8")
        logger.info("iteration %d: %d profiles (%s) in %s", k, n, stats["by_source"], d / "profiles.jsonl")

    def train(self, k: int) -> None:
        """Train until step k*S, resuming the last checkpoint; skipped when a checkpoint is already there."""
        d, target = self.iter_dir(k), k * self.args.steps_per_iteration
        step = checkpoint_step(self.ckpt_dir)
        if step >= target:
            logger.info("iteration %d: checkpoint at step %d >= %d, already trained", k, step, target)
            return
        if step < target - self.args.steps_per_iteration:
            raise RuntimeError(f"iteration {k} starts at step {target - self.args.steps_per_iteration} but the "
                               f"last checkpoint under {self.ckpt_dir} is at step {step}; was a checkpoint deleted?")
        if k > 1 and self.args.sim_restart_command and step == target - self.args.steps_per_iteration:
            self.restart_simulators()
        for log in ("rollouts.jsonl", "val_metrics.jsonl"):
            dropped = trim_to_step(d / log, step)
            if dropped:
                logger.info("iteration %d: dropped %d lines of %s logged after the checkpoint of step %d", k,
                            dropped, log, step)
        cmd = with_overrides(self.cmd, self.overrides(k))
        (d / "train.started").write_text(f"{time.time()}\nresuming from step {step}\n", encoding="utf-8")
        logger.info("iteration %d: training steps %d..%d%s", k, step + 1, target,
                    f" (resuming the checkpoint of step {step})" if step else "")
        done = subprocess.run(cmd)
        if done.returncode != 0:
            raise SystemExit(f"iteration {k}: the trainer failed (exit {done.returncode}); rerun the same command "
                             "to resume it")
        if checkpoint_step(self.ckpt_dir) < target:
            raise SystemExit(f"iteration {k}: the trainer ended without a checkpoint at step {target}")

    def restart_simulators(self) -> None:
        """Run --sim-restart-command; its last output line becomes the simulator URLs."""
        out = subprocess.run(self.args.sim_restart_command, shell=True, check=True, capture_output=True, text=True)
        urls = out.stdout.strip().splitlines()[-1]
        self.cmd = with_overrides(self.cmd, {URLS_KEY: f"'{urls}'"})
        logger.info("simulators restarted: %s", urls)

    def analyse(self, k: int) -> None:
        """ROOT/iter_0k/mistakes.json from this iteration's training dialogues."""
        d = self.iter_dir(k)
        if (d / "mistakes.json").is_file():
            return
        first = (k - 1) * self.args.steps_per_iteration + 1
        overrides = {key: v for key, v in self.controller.items() if key not in OWN_CONTROLLER_KEYS}
        result = analyze_by_split(read_dialogues(d / "rollouts.jsonl"), self.scenario, split="train",
                                  min_step=first, controller=overrides, min_count=self.args.min_count)
        tmp = d / "mistakes.json.tmp"
        tmp.write_text(json.dumps({"source": str(d / "rollouts.jsonl"), **result}, indent=1) + "\n",
                       encoding="utf-8")
        tmp.replace(d / "mistakes.json")
        a = result["splits"]["train"]
        logger.info("iteration %d: CR %.3f over %d training dialogues; mistakes analysis %s", k,
                    a["completion"]["cr"], a["n_scored"], d / "mistakes.json")

    def run(self) -> dict[str, Any]:
        """All iterations (completed ones skipped); returns and writes ROOT/iterations.json."""
        summary = []
        for k in range(1, self.args.iterations + 1):
            d = self.iter_dir(k)
            if not (d / "done.json").is_file():
                self.write_profiles(k)
                self.train(k)
                self.analyse(k)
                info = {"iteration": k, "steps": [(k - 1) * self.args.steps_per_iteration + 1,
                                                  k * self.args.steps_per_iteration],
                        "checkpoint": str(find_latest_checkpoint(self.ckpt_dir)), "dir": str(d)}
                (d / "done.json").write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
            else:
                logger.info("iteration %d: done (%s)", k, d / "done.json")
            summary.append(json.loads((d / "done.json").read_text(encoding="utf-8")))
        out = {"iterations": summary, "root": str(self.root), "checkpoints": str(self.ckpt_dir)}
        (self.root / "iterations.json").write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
        return out

    def print_plan(self) -> None:
        """The dry run: each iteration's trainer overrides."""
        print(f"iterations: {self.args.iterations} x {self.args.steps_per_iteration} steps under {self.root}")
        for k in range(1, self.args.iterations + 1):
            print(f"  iteration {k}: " + " ".join(f"{key}={v}" for key, v in self.overrides(k).items()))


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The driver's options and the trainer command after `--`."""
    if "--" not in argv:
        raise SystemExit("iterate.py: give the trainer command after '--'")
    split = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--iterations", type=int, required=True, help="number of iterations N")
    p.add_argument("--steps-per-iteration", type=int, required=True, help="training steps S per iteration")
    p.add_argument("--root", required=True, help="directory of the iterations' outputs")
    p.add_argument("--ckpt-dir", required=True, help="the trainer's checkpoint directory (trainer.default_local_dir)")
    p.add_argument("--scenario", required=True, help="scenario YAML")
    p.add_argument("--train-samples", type=int, required=True, help="rows of each iteration's train.parquet")
    p.add_argument("--profiles", type=int, default=1000, help="profiles written per iteration (its pool)")
    p.add_argument("--seed", type=int, default=0, help="base seed of the profile writer (iteration k: seed + k)")
    p.add_argument("--rules", default=None, help="behaviour rule table (default assets/behavior_rules.yaml)")
    p.add_argument("--llm-url", default=None,
                   help="OpenAI-compatible endpoint writing the profiles (key: $PROFILE_LLM_API_KEY, "
                        "else $OPENAI_API_KEY)")
    p.add_argument("--llm-model", default=None, help="its model name (default: the first it serves)")
    p.add_argument("--llm-timeout", type=float, default=60.0, help="seconds per profile request")
    p.add_argument("--system-prompt", default=None,
                   help="agent system prompt of the train rows (default: the scenario's; the CPU demo's compact one)")
    p.add_argument("--min-count", type=int, default=5, help="mistakes analysis: dialogues to rank a combination")
    p.add_argument("--sim-restart-command", default=None, help="shell command restarting the simulators")
    p.add_argument("--dry-run", action="store_true", help="print each iteration's overrides and stop")
    args = p.parse_args(argv[:split])
    if args.iterations < 1 or args.steps_per_iteration < 1:
        p.error("--iterations and --steps-per-iteration must be >= 1")
    return args, argv[split + 1:]


def main(argv: list[str] | None = None) -> int:
    """Run (or print) the iterations."""
    args, cmd = parse_args(sys.argv[1:] if argv is None else argv)
    if not cmd:
        raise SystemExit("iterate.py: the trainer command after '--' is empty")
    try:
        driver = IterationDriver(args, cmd)
        if args.dry_run:
            driver.print_plan()
            return 0
        driver.root.mkdir(parents=True, exist_ok=True)
        (driver.root / "command.txt").write_text(shlex.join(cmd) + "\n", encoding="utf-8")
        summary = driver.run()
    except (ValueError, RuntimeError, OSError) as exc:
        raise SystemExit(f"iterate.py: {exc}") from None
    print(json.dumps(summary, indent=1))
    return 0


def setup_logging() -> None:
    """The command line's logging: the driver's own lines at INFO, the modules it calls at WARNING."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s iterate: %(message)s", datefmt="%H:%M:%S")
    for quiet in ("llm_agent.controller", "llm_agent.scenario", "llm_agent.profiles.writer"):
        logging.getLogger(quiet).setLevel(logging.WARNING)  # the driver logs its own summary of each phase


if __name__ == "__main__":
    setup_logging()
    sys.exit(main())
