"""Benchmark: throughput, MFU / HFU and peak memory of the actor update (``update_actor``) on real FSDP workers.

    python -m bench.train_step [--batch B] [--prompt-length P] [--response-length R] [--iters 3]
                               [--out bench/results/train_step.json]
    python -m bench.train_step --preset gpu [--layers N] [--peak-tflops T]      # the production shape on CUDA
    python -m bench.train_step --long-dialogues [--batch B] [--micro-batch 4] [--max-token-len 16384]
                               [--out bench/results/train_step_long.json]

On CPU: the tiny Qwen2 model (``utils/make_tiny_model.py``) with 1 and 2 FSDP2 workers on gloo. On CUDA: a
Qwen2-0.5B-shaped model with random weights in bf16 on 1 and (if present) 2 GPUs. Each set-up starts an
``ActorRolloutRefWorker`` group (role ``actor``; :mod:`bench.train_step_worker`), computes real old log-probs
and runs one warm-up update, then times one log-prob pass and ``--iters`` PPO updates (one optimizer step each)
inside the workers between CUDA synchronisations, with the peak-memory counters reset after the warm-up.
Tokens are the attended prompt + response tokens (padding is not counted).

``--preset gpu``: the SEAD GPU preset's actor update (verl/trainer/config/preset/gpu.yaml): a Qwen2.5-7B-shaped model built from
its config alone (random bf16 weights; ``--layers N`` keeps the width and shortens the depth so it fits fewer
GPUs), 2,048 prompt + 6,144 response tokens per row (8,192: the preset's max_prompt_length and dialogue budget),
micro-batches by the preset's token budgets (16,384 tokens per update micro-batch, 32,768 per log-prob forward),
gradient checkpointing, padding-free forwards, bf16 compute with fp32 master weights, FSDP2 on NCCL over every GPU
Ray sees, 4 rows per GPU per update (bench/gpu_check.sh benchmarks 9,728-token rows on one GPU). The driver
never touches ``torch.cuda``: whether to use GPUs comes from Ray's resources, and the device name, timings and
memory (allocated and reserved) are read in the workers. MFU and HFU are defined in :mod:`bench.train_step_flops`.

``--long-dialogues``: one batch of calls whose lengths follow a skewed distribution between 256 and 4096 tokens
(:mod:`bench.long_dialogues`), trained by one worker twice in the same run: padded rows in micro-batches of
``--micro-batch`` rows, then packed rows (``use_remove_padding``) in micro-batches of at most
``--max-token-len`` tokens (``use_dynamic_bsz``, also for the log-prob pass); the JSON gets both rows and the
throughput ratio.
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import ray

from bench.train_step_flops import batch_flops, build_random_model, peak_flops, planned_memory_mib, utilisation
from bench.train_step_worker import BenchActorWorker
from bench.update_batch import make_batch
from verl.protocol import DataProto
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.trainer.config_schema import compose_config
from verl.trainer.presets import preset_args
from verl.utils.memory_model import ModelShape

REPO = Path(__file__).resolve().parent.parent

logger = logging.getLogger("bench.train_step")

# The GPU preset (verl/trainer/config/preset/gpu.yaml), as far as the actor update goes.
GPU_PRESET = {"prompt_length": 2048, "response_length": 6144, "micro_batch": 1, "log_prob_micro_batch": 2,
              "rows_per_gpu": 4, "iters": 3, "model": "qwen2.5-7b"}
GPU_PRESET_OVERRIDES = preset_args("gpu", ("actor_rollout_ref.model.use_remove_padding",
                                           "actor_rollout_ref.actor.use_dynamic_bsz",
                                           "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
                                           "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"))


def _bench_overrides(model_path: Path, args: argparse.Namespace, extra: tuple[str, ...]) -> list[str]:
    """The trainer-config overrides of one set-up."""
    return [
        f"actor_rollout_ref.model.path={model_path}", f"data.train_batch_size={args.batch}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro_batch}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.log_prob_micro_batch}",
        f"data.max_prompt_length={args.prompt_length}", f"data.max_response_length={args.response_length}",
        "actor_rollout_ref.actor.optim.total_training_steps=1000", "actor_rollout_ref.actor.optim.lr=1e-6",
        f"actor_rollout_ref.model.enable_gradient_checkpointing={str(args.gradient_checkpointing).lower()}",
        *extra,
    ]


def _per_call(measured: list[dict[str, Any]], method: str) -> list[float]:
    """Seconds of each call of ``method``: the slowest rank's (the step ends when the last rank does)."""
    return [max(calls) for calls in zip(*(rank["seconds"].get(method, []) for rank in measured))]


def _memory(measured: list[dict[str, Any]], prefix: str = "") -> dict[str, float | None]:
    """The largest rank's peak memory (MiB): allocated and reserved on CUDA, the resident set size on CPU."""
    def peak(key: str) -> float | None:
        values = [rank[key] for rank in measured if rank.get(key) is not None]
        return max(values) if values else None

    allocated = peak("max_allocated_mib")
    return {f"{prefix}peak_allocated_mib": allocated, f"{prefix}peak_reserved_mib": peak("max_reserved_mib"),
            f"{prefix}peak_rss_mib": peak("peak_rss_mib"),
            f"{prefix}peak_memory_mib": allocated if allocated is not None else peak("peak_rss_mib")}


def _warn_if_too_large(planned_mib: float, device_info: list[dict[str, Any]]) -> None:
    """Log a warning when the planner's update estimate exceeds the workers' GPU memory."""
    totals = [info["total_memory_mib"] for info in device_info if "total_memory_mib" in info]
    if totals and planned_mib > min(totals):
        logger.warning("the planner expects %.0f MiB per GPU for the update but the GPU has %.0f MiB: expect an "
                       "out-of-memory error (fewer --layers, or more GPUs)", planned_mib, min(totals))


def run_setup(
    model_path: Path, workers: int, use_gpu: bool, args: argparse.Namespace, data: DataProto | None = None,
    extra_overrides: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Start a worker group, warm up, then time one log-prob pass and ``args.iters`` actor updates of ``data``
    (default: a random full-length batch) inside the workers; return times, peak memory and FLOPs."""
    overrides = _bench_overrides(model_path, args, extra_overrides)
    config = compose_config(overrides)
    planned = planned_memory_mib([*overrides, f"trainer.n_gpus_per_node={workers}"])
    pool = RayResourcePool([workers], use_gpu=use_gpu, name_prefix=f"bench{workers}")
    group = None
    try:
        group = RayWorkerGroup(pool, RayClassWithInitArgs(BenchActorWorker, config=config.actor_rollout_ref,
                                                          role="actor"))
        group.init_model()
        device_info = group.device_info()
        _warn_if_too_large(planned["update"], device_info)
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model_path).vocab_size
        if data is None:
            data = make_batch(args.batch, args.prompt_length, args.response_length, vocab)
        data = copy.deepcopy(data)  # the caller's batch stays without old_log_probs
        data = data.union(group.compute_log_prob(data).select(batch_keys=["old_log_probs"]))
        group.update_actor(data)  # warm-up: allocator, kernels, optimizer states
        group.reset_measurements()
        group.compute_log_prob(data)
        log_prob = group.measurements()
        group.reset_measurements()
        wall = []
        for _ in range(args.iters):
            start = time.perf_counter()
            group.update_actor(data)
            wall.append(time.perf_counter() - start)
        update = group.measurements()
    finally:
        if group is not None:
            group.shutdown()
        pool.remove()
    times = _per_call(update, "update_actor")
    log_prob_s = _per_call(log_prob, "compute_log_prob")[0]
    tokens = int(data.batch["attention_mask"].sum())
    seconds = statistics.median(times)
    flops = batch_flops(ModelShape.from_model_dir(model_path), data, data.batch["responses"].shape[1],
                        args.gradient_checkpointing)
    return {"workers": workers, "tokens_per_update": tokens, "update_s": seconds, "update_s_all": times,
            "update_wall_s_all": wall, "tokens_per_s": tokens / seconds, "log_prob_s": log_prob_s,
            "log_prob_tokens_per_s": tokens / log_prob_s, **_memory(update), **_memory(log_prob, "log_prob_"),
            "planned_update_mib": planned["update"], "planned_log_prob_mib": planned["log_prob"],
            "flops": {"model": flops.model, "hardware": flops.hardware, "forward": flops.forward,
                      "attention_forward": flops.attention_forward, "recompute_forward": flops.recompute_forward},
            "device_info": device_info, "ranks": update}


def add_utilisation(result: dict[str, Any], override_tflops: float | None) -> None:
    """Give every row of ``result`` its MFU, HFU and log-prob MFU against the workers' device peak."""
    name = result["results"][0]["device_info"][0]["name"]
    peak, source = peak_flops(name, override_tflops)
    result["device"], result["peak_flops"], result["peak_flops_source"] = name, peak, source
    for row in result["results"]:
        flops, n = row["flops"], row["workers"]
        row["mfu"] = utilisation(flops["model"], row["update_s"], peak, n)
        row["hfu"] = utilisation(flops["hardware"], row["update_s"], peak, n)
        row["log_prob_mfu"] = utilisation(flops["forward"], row["log_prob_s"], peak, n)


def run_long_dialogues(model: Path, use_gpu: bool, args: argparse.Namespace) -> dict[str, Any]:
    """Padded + fixed-size vs packed + token-budget updates of one long-dialogue batch, one worker each."""
    from transformers import AutoConfig

    from bench.long_dialogues import length_summary, make_long_dialogue_batch

    data = make_long_dialogue_batch(args.batch, AutoConfig.from_pretrained(model).vocab_size,
                                    prompt_width=args.prompt_length, max_len=args.prompt_length + args.response_length)
    packed = ("actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.use_dynamic_bsz=true",
              f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={args.max_token_len}")
    rows = []
    for setup, extra in (("padded+fixed", ()), ("packed+dynamic", packed)):
        logger.info("long dialogues: %s", setup)
        rows.append({"setup": setup, **run_setup(model, 1, use_gpu, args, data=data, extra_overrides=extra)})
    return {"lengths": length_summary(data), "max_token_len": args.max_token_len,
            "throughput_ratio": rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"],
            "log_prob_throughput_ratio": rows[1]["log_prob_tokens_per_s"] / rows[0]["log_prob_tokens_per_s"],
            "peak_memory_ratio": rows[1]["peak_memory_mib"] / rows[0]["peak_memory_mib"], "results": rows}


def _percent(value: float | None) -> str:
    return f"{100 * value:.1f}%" if value is not None else "n/a"


def _mib(value: float | None) -> str:
    return f"{value:.0f}" if value is not None else "n/a"


def format_table(result: dict[str, Any]) -> str:
    """The result rows as a console table, with the FLOP definitions under it."""
    shape = (f"lengths {result['lengths']}" if "lengths" in result
             else f"{result['prompt_length']}+{result['response_length']} tokens")
    lines = [f"{result['model']}, {result['parameters'] / 1e6:.2f} M parameters, batch {result['batch']}, "
             f"micro-batch {result['micro_batch']}, {shape}, gradient checkpointing "
             f"{'on' if result['gradient_checkpointing'] else 'off'}, device {result['device']} "
             f"(peak {result['peak_flops_source']})",
             f"{'setup':>15} | {'workers':>7} | {'update s':>9} | {'tokens/s':>10} | {'MFU':>6} | {'HFU':>6} | "
             f"{'log-prob s':>10} | {'lp MFU':>6} | {'alloc MiB':>9} | {'rsrvd MiB':>9} | {'RSS MiB':>8} | "
             f"{'plan MiB':>8}"]
    for row in result["results"]:
        lines.append(f"{row['setup']:>15} | {row['workers']:>7} | {row['update_s']:>9.3f} | "
                     f"{row['tokens_per_s']:>10.0f} | {_percent(row['mfu']):>6} | {_percent(row['hfu']):>6} | "
                     f"{row['log_prob_s']:>10.3f} | {_percent(row['log_prob_mfu']):>6} | "
                     f"{_mib(row['peak_allocated_mib']):>9} | {_mib(row['peak_reserved_mib']):>9} | "
                     f"{_mib(row['peak_rss_mib']):>8} | {_mib(row['planned_update_mib']):>8}")
    if "throughput_ratio" in result:
        lines.append(f"packed+dynamic / padded+fixed: update tokens/s x{result['throughput_ratio']:.2f}, log-prob "
                     f"x{result['log_prob_throughput_ratio']:.2f}, peak memory x{result['peak_memory_ratio']:.2f}")
    lines.append("MFU = 3 x (2 x layer matmul weights x tokens + 2 x hidden x vocab x response positions + causal "
                 "attention 4 x layers x heads x head_dim x T(T+1)/2 per row) / (update s x peak x GPUs); HFU adds "
                 "the checkpointing recompute (each layer's forward but its down projection); lp MFU: the forward "
                 "alone over the log-prob pass. Memory: the largest rank's peak during the timed updates; plan: the "
                 "planner's estimate of the update (bf16 on CUDA, no CUDA context).")
    return "\n".join(lines)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=("default", "gpu"), default="default",
                        help="gpu: the GPU preset's 7B-shaped actor update at 8,192 tokens per row (see above)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: cuda when Ray sees a GPU on this machine")
    parser.add_argument("--model", choices=("tiny", "qwen2-0.5b", "qwen2.5-7b"), default=None,
                        help="default tiny on CPU, qwen2-0.5b on CUDA, qwen2.5-7b with --preset gpu")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers of a generated shape (the width "
                        "stays); e.g. --layers 8 fits the 7B width on one 80 GB GPU")
    parser.add_argument("--workers", type=str, default=None, help="comma-separated worker (GPU) counts; default "
                        "1,2 (CUDA: 1 and 2 when present; --preset gpu: every GPU)")
    parser.add_argument("--batch", type=int, default=None,
                        help="rows per update (default 32 on CPU, 64 on CUDA, 4 per GPU with --preset gpu; long "
                        "dialogues: 16 / 64)")
    parser.add_argument("--micro-batch", type=int, default=None, help="rows per forward/backward (default 8; "
                        "long dialogues: 4; --preset gpu: 1)")
    parser.add_argument("--log-prob-micro-batch", type=int, default=None,
                        help="rows per log-prob forward (default: --micro-batch; --preset gpu: 2)")
    parser.add_argument("--prompt-length", type=int, default=None, help="default 96 on CPU, 960 on CUDA, 2048 "
                        "with --preset gpu; long dialogues: 256 (prompt width)")
    parser.add_argument("--response-length", type=int, default=None, help="default 32 on CPU, 64 on CUDA, 6144 "
                        "with --preset gpu; long dialogues: 3840 (conversation width)")
    parser.add_argument("--iters", type=int, default=None, help="timed updates after one warm-up (default 3)")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="on by default with --preset gpu")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="peak dense bf16 TFLOP/s of one device (default: the table in bench.train_step_flops "
                        "by the device name the workers report)")
    parser.add_argument("--long-dialogues", action="store_true", help="padded+fixed vs packed+dynamic on a batch "
                        "of skewed call lengths (256-4096 tokens)")
    parser.add_argument("--max-token-len", type=int, default=16384,
                        help="packed+dynamic: ppo_max_token_len_per_gpu (tokens per micro-batch)")
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/train_step.json "
                        "(long dialogues: train_step_long.json; --preset gpu: train_step_gpu.json)")
    args = parser.parse_args(argv)
    if args.preset == "gpu" and args.long_dialogues:
        parser.error("--preset gpu and --long-dialogues are separate benchmarks")
    return args


def _apply_defaults(args: argparse.Namespace, use_gpu: bool, gpus: int) -> None:
    """Fill the options left unset from the preset and the device (see ``--help``)."""
    if args.workers is not None:
        args.worker_counts = [int(w) for w in args.workers.split(",")]
    elif args.preset == "gpu" and use_gpu:
        args.worker_counts = [gpus]
    else:
        args.worker_counts = [1, 2] if not use_gpu or gpus >= 2 else [1]
    if use_gpu and max(args.worker_counts) > gpus:
        raise SystemExit(f"--workers {args.worker_counts} needs more GPUs than Ray sees ({gpus})")
    if args.preset == "gpu":
        p = GPU_PRESET
        defaults = {"batch": p["rows_per_gpu"] * max(args.worker_counts), "micro_batch": p["micro_batch"],
                    "log_prob_micro_batch": p["log_prob_micro_batch"], "prompt_length": p["prompt_length"],
                    "response_length": p["response_length"], "model": p["model"]}
        args.gradient_checkpointing = True
    elif args.long_dialogues:
        defaults = {"batch": 64 if use_gpu else 16, "micro_batch": 4, "prompt_length": 256, "response_length": 3840}
    elif use_gpu:
        defaults = {"batch": 64, "micro_batch": 8, "prompt_length": 960, "response_length": 64}
    else:
        defaults = {"batch": 32, "micro_batch": 8, "prompt_length": 96, "response_length": 32}
    defaults.setdefault("model", "qwen2-0.5b" if use_gpu else "tiny")
    defaults.setdefault("iters", 3)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.log_prob_micro_batch is None:
        args.log_prob_micro_batch = args.micro_batch
    if args.model == "tiny" and args.layers is not None:
        raise SystemExit("--layers applies to the generated shapes (qwen2-0.5b, qwen2.5-7b), not the tiny model")
    if args.out is None:
        name = {"gpu": "train_step_gpu.json"}.get(args.preset, "train_step_long.json" if args.long_dialogues
                                                  else "train_step.json")
        args.out = REPO / "bench/results" / name


def _use_gpu(device: str) -> tuple[bool, int]:
    """(train on GPUs, how many Ray sees) from Ray's resources: no torch.cuda call in this process."""
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if device == "cuda" and gpus == 0:
        raise SystemExit("--device cuda: Ray sees no GPU on this machine")
    return (gpus > 0 if device == "auto" else device == "cuda"), gpus


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the set-ups of this machine (CPU or CUDA), print a table and write the JSON results."""
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as scripts/main.sh on GPUs
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address="local", num_cpus=8, include_dashboard=False)
    try:
        use_gpu, gpus = _use_gpu(args.device)
        _apply_defaults(args, use_gpu, gpus)
        from utils.make_tiny_model import build_tiny_model

        with tempfile.TemporaryDirectory() as tmp:
            tiny = build_tiny_model(Path(tmp) / "tiny", seed=0)
            if args.model == "tiny":
                model, name = tiny, "tiny qwen2"
            else:
                logger.info("building a random %s model (%s layers) from its config", args.model,
                            args.layers or "all")
                model = build_random_model(args.model, Path(tmp) / args.model, tiny, args.layers)
                name = f"{args.model}-shape (random weights" + (f", {args.layers} layers)" if args.layers else ")")
            params = ModelShape.from_model_dir(model).num_params()
            model_config = json.loads((Path(model) / "config.json").read_text())
            if args.long_dialogues:
                result = run_long_dialogues(model, use_gpu, args)
            else:
                extra = GPU_PRESET_OVERRIDES if args.preset == "gpu" else ()
                label = "packed" if args.preset == "gpu" else "padded"
                result = {"results": [{"setup": label, **run_setup(model, w, use_gpu, args, extra_overrides=extra)}
                                      for w in args.worker_counts]}
    finally:
        if started_ray:
            ray.shutdown()
    add_utilisation(result, args.peak_tflops)
    result = {"model": name, "parameters": params, "model_config": model_config, "preset": args.preset,
              "batch": args.batch,
              "micro_batch": args.micro_batch, "log_prob_micro_batch": args.log_prob_micro_batch,
              "prompt_length": args.prompt_length, "response_length": args.response_length,
              "gradient_checkpointing": args.gradient_checkpointing, "iters": args.iters, **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(format_table(result))
    print(f"results written to {args.out}")
    return result


if __name__ == "__main__":
    main()
