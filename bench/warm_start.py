"""Benchmark: the CPU recipe's warm start (utils/cpu_recipe.py) with and without keeping each layer's gathered
weights from its forward to its backward (FSDP2 ``reshard_after_forward``), side by side.

    python -m bench.warm_start [--steps 100] [--repeats 2] [--seed 0] [--dialogues 1024]
                               [--out bench/results/warm_start.json]

The recipe's own SFT command (two torchrun ranks on gloo, one transcript per forward) on the recipe's model and
scripted calls (``--dialogues`` of them), ``--steps`` steps, the two set-ups alternating ``--repeats`` times. Per
set-up: the median of the SFT loop's seconds (``sft_log.json``), the time per step, and whether the per-step
losses and the exported weights equal the other set-up's bit for bit.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.results import write_result
from llm_agent.scenario import DEFAULT_SCENARIO_PATH, load_scenario
from utils.cpu_recipe import RECIPE, REPO, warm_start_command, warm_start_env

logger = logging.getLogger("bench.warm_start")

SETUPS = {"reshard after forward": False, "keep gathered weights": True}


def sha256(path: Path) -> str:
    """The file's SHA-256 hex digest."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="SFT steps per run (the recipe's: %d)" % RECIPE.sft_steps)
    p.add_argument("--repeats", type=int, default=2, help="runs of each set-up, alternating")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dialogues", type=int, default=RECIPE.sft_dialogues, help="scripted calls to train on")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "warm_start.json")
    args = p.parse_args(argv)
    if min(args.steps, args.repeats, args.dialogues) < 1:
        p.error("--steps, --repeats and --dialogues must be >= 1")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from utils.make_tiny_model import build_tiny_model
    from utils.sft_warm_start import scripted_dialogues

    load_at_start = os.getloadavg()[0]
    runs: dict[str, list[dict]] = {name: [] for name in SETUPS}
    with tempfile.TemporaryDirectory(prefix="bench_warm_start_") as tmp:
        base = build_tiny_model(Path(tmp) / "tiny_model", seed=args.seed, spec=RECIPE.model_spec,
                                scenarios=[DEFAULT_SCENARIO_PATH])
        prompt = load_scenario(DEFAULT_SCENARIO_PATH).agent_compact_prompt
        dialogues = scripted_dialogues(DEFAULT_SCENARIO_PATH, args.dialogues, RECIPE.sft_mix, seed=args.seed,
                                       max_turns=RECIPE.max_turns, system_prompt=prompt)
        transcripts = Path(tmp) / "transcripts.jsonl"
        transcripts.write_text("".join(json.dumps(d) + "\n" for d in dialogues), encoding="utf-8")
        for repeat in range(args.repeats):
            for name, keep in SETUPS.items():
                out = Path(tmp) / f"run_{repeat}_{keep}"
                command = warm_start_command(RECIPE, base, out, transcripts, args.seed, args.steps, keep)
                subprocess.run(command, cwd=REPO, env=warm_start_env(), stdout=subprocess.DEVNULL, check=True)
                log = json.loads((out / "sft_log.json").read_text())
                runs[name].append({"seconds": log["seconds"], "losses": log["losses"],
                                   "weights_sha256": sha256(out / "model.safetensors")})
                logger.info("%s, run %d: %.1f s", name, repeat + 1, log["seconds"])
    reference = runs["reshard after forward"][0]
    rows = []
    for name, done in runs.items():
        median = statistics.median(r["seconds"] for r in done)
        rows.append({"setup": name, "runs": [r["seconds"] for r in done], "median_s": median,
                     "ms_per_step": round(1000 * median / args.steps, 1),
                     "same_losses": all(r["losses"] == reference["losses"] for r in done),
                     "same_weights": all(r["weights_sha256"] == reference["weights_sha256"] for r in done)})
    ratio = rows[0]["median_s"] / rows[1]["median_s"]
    print(f"\nwarm start, {args.steps} SFT steps, {args.repeats} run(s) each, seed {args.seed}")
    print(f"{'set-up':<24} {'median s':>9} {'ms/step':>8} {'same losses':>12} {'same weights':>13}")
    for r in rows:
        print(f"{r['setup']:<24} {r['median_s']:>9.2f} {r['ms_per_step']:>8.1f} {str(r['same_losses']):>12} "
              f"{str(r['same_weights']):>13}")
    print(f"speed-up of keeping the gathered weights: {ratio:.3f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args, load_at_start, {"torch_threads_per_rank": 1, "python_executable": sys.executable},
                 rows=rows, speedup=round(ratio, 3))


if __name__ == "__main__":
    main()
