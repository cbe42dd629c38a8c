"""Benchmark: the GPU presets traced at full size on CPU beside the planner (issue 41).

    python -m bench.trace_presets [--models tests/data/models] [--out bench/results/trace_presets.json]

For Qwen2.5-7B (preset ``gpu``, 6 GPUs), Qwen2.5-14B (``gpu``, 6 GPUs) and Qwen2.5-14B with LoRA (``gpu_lora``,
2 GPUs), from the ``config.json`` files in ``--models``: the trainer keys ``scripts/main.sh --dry-run`` prints for
the preset, traced in this process (:func:`verl.trainer.trace_preset.trace_preset`). Per phase the planner's and
the trace's GB of every line item, the line items that differ, the collectives, and the CPU seconds of the trace.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import time
from pathlib import Path

from bench.results import write_result
from verl.trainer.trace_preset import trace_preset

REPO = Path(__file__).resolve().parents[1]
CASES = {"7B gpu": ("qwen2.5-7b-instruct", "gpu"), "14B gpu": ("qwen2.5-14b-instruct", "gpu"),
         "14B gpu_lora": ("qwen2.5-14b-instruct", "gpu_lora")}


def preset_keys(model_dir: Path, preset: str) -> list[str]:
    """The trainer overrides of ``preset`` for ``model_dir``, as ``scripts/main.sh --dry-run`` prints them."""
    env = {**{k: v for k, v in os.environ.items() if k not in ("PRESET", "MODEL_PATH")},
           "PRESET": preset, "MODEL_PATH": str(model_dir), "USER_SIM_URLS": "http://127.0.0.1:5000",
           "OUTPUT_DIR": "/tmp/trace_presets_outputs"}
    done = subprocess.run(["bash", str(REPO / "scripts" / "main.sh"), "--dry-run"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, check=True)
    lines = done.stdout.splitlines()
    command = lines[lines.index("trainer command:") + 1:]
    words = shlex.split(" ".join(line.strip().removesuffix("\\") for line in command))
    start = words.index("verl.trainer.main_ppo") + 3  # python -m verl.trainer.main_ppo --config-name sead_trainer
    return words[start:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, default=REPO / "tests" / "data" / "models")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "trace_presets.json")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    cases = {}
    for name, (model, preset) in CASES.items():
        keys = preset_keys(args.models / model, preset)
        start = time.process_time()
        result = trace_preset(keys, "sead_trainer")
        seconds = time.process_time() - start
        report = result.report
        print(f"== {name}: {len(report.differences)} line items differ; {seconds:.0f} s of CPU")
        print(report.format())
        cases[name] = {
            "cpu_seconds": seconds, "differences": report.differences,
            "items": [{"phase": i.phase, "item": i.item, "planned_gb": i.planned / 1e9, "traced_gb": i.traced / 1e9}
                      for i in report.items],
            "collectives": [{"phase": c.phase, "kind": c.kind, "dtype": c.dtype, "planned": list(c.planned),
                             "traced": list(c.traced)} for c in report.collectives],
            "notes": report.notes}
    write_result(args, load, cases=cases)


if __name__ == "__main__":
    main()
