"""Benchmark: the CI's tiny LLM simulator before and after fine-tuning, graded by the simulator report card.

    .venv-vllm/bin/python -m bench.simulator_sft [--recipe full|quick | --simulator DIR] [--probe-dialogues 48]
        [--out-root outputs/simulator_sft] [--bootstrap 1000] [--out bench/results/simulator_sft.json]

Makes (or reuses, in `<out-root>/tiny-<recipe>`) the tiny simulator of `--recipe` (`utils.simulator_sft`: the tiny
Qwen2 base model, then supervised fine-tuning on scripted calls; the time it took is in its `sft_log.json`), or
takes one made already (`--simulator DIR`, e.g. the `vllm` test's in outputs/test_cache/), then serves the base model
and the fine-tuned one in turn with vLLM's OpenAI server (`scripts/start_user_sims.sh --backend vllm`, the CPU
flags of docs/simulator.md) and grades each on the fixed probes with the rollout loop's decoding settings; the
scripted persona (in process) is graded too, as the reference. Prints the cards side by side and writes them
with the machine to `--out` (and each card to `<out-root>/cards/`). Run it with the vLLM environment's python.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.results import write_result
from for_evaluation.simulator_report import cards_table
from llm_agent.scenario import DEFAULT_SCENARIO_PATH, load_scenario
from llm_agent.simulator_report import ProbeSampling, build_card, build_probe_set, run_probes
from llm_agent.stand_ins.inprocess_user_sim import InProcessUserSim
from llm_agent.user_sim.client import UserSimClient
from llm_agent.user_sim.processes import free_port
from utils.simulator_sft import INFO_FILE, RECIPES, tiny_simulator

REPO = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 4096
VLLM_CPU_FLAGS = ["--dtype", "float32", "--enforce-eager", "--no-enable-chunked-prefill",
                  "--max-num-batched-tokens", str(MAX_MODEL_LEN)]


def served_card(model: Path, name: str, probes, scenario, args: argparse.Namespace, run_dir: Path) -> dict:
    """Serve `model` with vLLM, grade it on the probes, stop it."""
    env = {**os.environ, "VLLM_PYTHON": sys.executable, "VLLM_CPU_KVCACHE_SPACE": "1", "RUN_DIR": str(run_dir)}
    started = time.monotonic()
    start = subprocess.run(["bash", "scripts/start_user_sims.sh", "--backend", "vllm", "--model", str(model),
                            "--base-port", str(free_port()), "--max-model-len", str(MAX_MODEL_LEN), "--timeout", "600",
                            "--", *VLLM_CPU_FLAGS], cwd=REPO, env=env, capture_output=True, text=True)
    if start.returncode != 0:
        raise SystemExit(f"vLLM did not start for {model}:\n{start.stderr[-3000:]}")
    url = start.stdout.strip().splitlines()[-1]
    startup_s = time.monotonic() - started
    try:
        with UserSimClient(url, timeout_s=300) as client:
            graded = run_probes(client, probes, scenario, ProbeSampling(seed=args.seed), args.concurrency)
    finally:
        subprocess.run(["bash", "scripts/stop_user_sims.sh"], cwd=REPO, env=env, capture_output=True)
    card = build_card(graded, scenario, name, {"kind": "vLLM (vllm-cpu)", "model": str(model),
                                               "probes": probes.describe(), "vllm_startup_s": round(startup_s, 1)},
                      n_resamples=args.bootstrap, seed=args.seed)
    return card


def main(argv: list[str] | None = None) -> None:
    """Make the simulator, grade base / fine-tuned / scripted, print and write the results."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", choices=sorted(RECIPES), default="full", help="the tiny simulator's recipe")
    p.add_argument("--simulator", type=Path, default=None, help="grade this tiny simulator (made already)")
    p.add_argument("--out-root", type=Path, default=REPO / "outputs" / "simulator_sft")
    p.add_argument("--probe-dialogues", type=int, default=48)
    p.add_argument("--bootstrap", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "simulator_sft.json")
    args = p.parse_args(argv)
    load_at_start = os.getloadavg()[0]
    scenario = load_scenario(DEFAULT_SCENARIO_PATH)
    tiny = args.simulator or tiny_simulator(args.out_root / f"tiny-{args.recipe}", DEFAULT_SCENARIO_PATH,
                                            RECIPES[args.recipe])
    info = json.loads((tiny / INFO_FILE).read_text())
    sft_log = json.loads((tiny / "sft_log.json").read_text())
    probes = build_probe_set(scenario, args.probe_dialogues)
    run_dir = args.out_root / "bench_run"
    cards = [served_card(tiny / info["base"], "tiny base (untrained)", probes, scenario, args, run_dir),
             served_card(tiny, "tiny SFT", probes, scenario, args, run_dir)]
    with InProcessUserSim(scenario) as sim:
        cards.append(build_card(run_probes(sim, probes, scenario, ProbeSampling(seed=args.seed)), scenario,
                                "scripted persona", {"kind": "scripted (in process)"}, n_resamples=args.bootstrap,
                                seed=args.seed))
    (args.out_root / "cards").mkdir(parents=True, exist_ok=True)
    for card, stem in zip(cards, ("base", "sft", "scripted")):
        (args.out_root / "cards" / f"{stem}.json").write_text(json.dumps(card, indent=1))
    print(cards_table(cards))
    print(f"fine-tuning: {sft_log['steps']} steps on {info['rows']} sequences ({info['kept']} replies kept of "
          f"{info['examples']}) in {sft_log['seconds']:.0f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args, load_at_start, cards=cards, fine_tuning={"seconds": sft_log["seconds"], "steps":
                 sft_log["steps"], "examples": info["examples"], "kept": info["kept"], "rows": info["rows"],
                 "tokens": info["tokens"]})


if __name__ == "__main__":
    main()
