"""Benchmark: the simulator SFT's ingestion of a rollout log holding one huge reply, beside the report card reading
the same log.

    python -m bench.simulator_sft_ingestion [--sizes-mb 4,12.5,25,50] [--dialogues 64] [--turns 8]
        [--max-length 8192] [--out bench/results/simulator_sft_ingestion.json]

For each size, writes a rollout log of `--dialogues` dialogues of `--turns` simulator turns each; one of them has a
reply of that many megabytes in its first turn, so each of its later requests repeats it. Then, each in a fresh
child process: the report card of the log (`python -m for_evaluation.simulator_report --dialogues LOG --bootstrap
0`) and the simulator SFT's ingestion of it (`utils.simulator_sft.logged_examples` and `training_rows` with the tiny
model's tokenizer at `--max-length`: everything `--rollouts` does before training). Prints each one's wall time and
peak memory (the child's maximum resident set size) per size, and the SFT / card ratio; writes them with the machine
to `--out`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.results import write_result
from llm_agent.scenario import DEFAULT_SCENARIO_PATH, UserProfile, load_scenario

REPO = Path(__file__).resolve().parents[1]
WORDS = ("fine", "who", "is", "this", "calling", "maybe", "later", "tell", "me", "more", "about", "it")


def write_log(path: Path, scenario_path: str, dialogues: int, turns: int, huge_chars: int) -> int:
    """A rollout log as the loop writes it; dialogue 0's first reply is `huge_chars` long. Returns its bytes."""
    scenario = load_scenario(scenario_path)
    state = {dim: 2 for dim in scenario.dims}
    profile = UserProfile(state, behaviors=()).to_dict()
    with open(path, "w", encoding="utf-8") as fh:
        for d in range(dialogues):
            records = []
            for t in range(turns):
                words = " ".join(WORDS[(d + t + k) % len(WORDS)] for k in range(6))
                reply = (words + " ") * (huge_chars // (len(words) + 1)) if d == 0 and t == 0 else words + "?"
                records.append({"agent_text": scenario.format_agent_output(f"Hello, this is Mia, turn {t}.", 0, 0,
                                                                           state),
                                "agent_status": 0, "user_reply": reply, "user_status": 0, "user_state": state,
                                "user_source": "simulator", "user_error": None})
            line = {"step": 1, "split": "train", "dialogue_id": f"bench#{d}", "profile": profile,
                    "outcome": "timeout", "turns": records, "sim_retries": 0}
            fh.write(json.dumps(line) + "\n")
    return path.stat().st_size


def child_sft(log: str, model: str, scenario_path: str, max_length: int) -> None:
    """The SFT's ingestion of `log` (run in a child process by the benchmark)."""
    from transformers import AutoTokenizer

    from utils.simulator_sft import logged_examples, training_rows

    scenario = load_scenario(scenario_path)
    examples = logged_examples([log], scenario)
    _, counts = training_rows(AutoTokenizer.from_pretrained(model), examples, scenario, max_length)
    print(json.dumps(counts))


def run_measured(command: list[str]) -> dict:
    """Wall seconds and peak RSS (MiB, the kernel's ru_maxrss of exactly that child) of `command` run as a child
    process, and the last line it printed."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(command[:5])} failed with status {os.waitstatus_to_exitcode(status)}")
    return {"seconds": round(seconds, 2), "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 2),
            "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
            "output": (out.strip().splitlines() or [""])[-1]}


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mb", default="4,12.5,25,50", help="sizes of the huge reply, comma-separated")
    p.add_argument("--dialogues", type=int, default=64)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--max-length", type=int, default=8192, help="the SFT's tokens per sequence (its default)")
    p.add_argument("--scenario", default=str(DEFAULT_SCENARIO_PATH))
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "simulator_sft_ingestion.json")
    p.add_argument("--child-sft", nargs=2, metavar=("LOG", "MODEL"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_sft:
        child_sft(*args.child_sft, args.scenario, args.max_length)
        return
    from utils.make_tiny_model import build_tiny_model

    load_at_start = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="sft_ingestion_") as tmp:
        model = str(build_tiny_model(Path(tmp) / "tiny", seed=0))
        for size in (float(s) for s in args.sizes_mb.split(",")):
            log = Path(tmp) / f"rollouts_{size:g}mb.jsonl"
            log_bytes = write_log(log, args.scenario, args.dialogues, args.turns, int(size * 1e6))
            card = run_measured([sys.executable, "-m", "for_evaluation.simulator_report", "--dialogues", str(log),
                                 "--bootstrap", "0", "--scenario", args.scenario, "--out", str(Path(tmp) / "c.json")])
            sft = run_measured([sys.executable, "-m", "bench.simulator_sft_ingestion", "--child-sft", str(log), model,
                                "--scenario", args.scenario, "--max-length", str(args.max_length)])
            rows.append({"reply_mb": size, "log_mb": round(log_bytes / 1e6, 1), "card": card, "sft": sft,
                         "time_ratio": round(sft["seconds"] / card["seconds"], 2),
                         "cpu_ratio": round(sft["cpu_seconds"] / card["cpu_seconds"], 2)})
            log.unlink()
    print(f"{'reply MB':>8} {'log MB':>7} {'card s':>7} {'cpu s':>6} {'MiB':>5} {'sft s':>6} {'cpu s':>6} {'MiB':>5} "
          f"{'sft/card wall':>13} {'cpu':>5}")
    for r in rows:
        c, t = r["card"], r["sft"]
        print(f"{r['reply_mb']:>8g} {r['log_mb']:>7g} {c['seconds']:>7.2f} {c['cpu_seconds']:>6.2f} "
              f"{c['peak_rss_mib']:>5.0f} {t['seconds']:>6.2f} {t['cpu_seconds']:>6.2f} {t['peak_rss_mib']:>5.0f} "
              f"{r['time_ratio']:>13.2f} {r['cpu_ratio']:>5.2f}")
    print(f"sft counts at the largest size: {rows[-1]['sft']['output']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args, load_at_start, rows=rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
