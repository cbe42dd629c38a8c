"""Benchmark: throughput and peak memory of the actor update (``update_actor``) on real FSDP workers.

    python -m bench.train_step [--batch B] [--prompt-length P] [--response-length R] [--iters 3]
                               [--out bench/results/train_step.json]

On CPU: the tiny Qwen2 model (``utils/make_tiny_model.py``) with 1 and 2 FSDP2 workers on gloo. On CUDA: a
Qwen2-0.5B-shaped model with random weights in bf16 on 1 and (if present) 2 GPUs, with the model-FLOPs
utilisation (6 x parameters x tokens per second over the GPU's dense bf16 peak). Each set-up starts an
``ActorRolloutRefWorker`` group (role ``actor``), computes real old log-probs once, then times
``--iters`` PPO updates (one optimizer step each) after one warm-up update. Tokens are prompt + response tokens.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
import torch

from verl.protocol import DataProto
from verl.single_controller.base import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.trainer.config_schema import compose_config
from verl.workers.fsdp_workers import ActorRolloutRefWorker

REPO = Path(__file__).resolve().parent.parent

logger = logging.getLogger("bench.train_step")

# Dense bf16 peak FLOP/s by GPU name fragment (vendor data sheets, without sparsity).
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12, "4090": 165e12}


class BenchActorWorker(ActorRolloutRefWorker):
    """The actor worker plus a peak-memory probe."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def peak_memory_mb(self) -> float:
        """Peak CUDA memory allocated (on GPU) or peak resident set size of the process (on CPU), in MiB."""
        if torch.cuda.is_available():
            return torch.cuda.max_memory_allocated() / 2**20
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build_qwen2_half_b(out_dir: Path, tokenizer_dir: Path) -> tuple[Path, int]:
    """Write a random-weight model with Qwen2-0.5B's shape (tokenizer copied from ``tokenizer_dir``)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True, rope_theta=1e6)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out_dir)
    return out_dir, model.num_parameters()


def make_batch(batch: int, prompt_length: int, response_length: int, vocab: int, seed: int = 0) -> DataProto:
    """Random full-length sequences with the keys update_actor needs (old_log_probs added later)."""
    gen = torch.Generator().manual_seed(seed)
    total = prompt_length + response_length
    input_ids = torch.randint(0, vocab, (batch, total), generator=gen)
    return DataProto.from_dict(tensors={
        "input_ids": input_ids, "attention_mask": torch.ones(batch, total, dtype=torch.long),
        "position_ids": torch.arange(total).expand(batch, total).clone(),
        "responses": input_ids[:, prompt_length:].clone(),
        "response_mask": torch.ones(batch, response_length, dtype=torch.long),
        "advantages": torch.randn(batch, response_length, generator=gen),
    })


def run_setup(model_path: Path, workers: int, use_gpu: bool, args: argparse.Namespace) -> dict[str, Any]:
    """Start a worker group, time ``args.iters`` actor updates, return tokens/s and peak memory."""
    overrides = [
        f"actor_rollout_ref.model.path={model_path}", f"data.train_batch_size={args.batch}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro_batch}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.micro_batch}",
        f"data.max_prompt_length={args.prompt_length}", f"data.max_response_length={args.response_length}",
        "actor_rollout_ref.actor.optim.total_training_steps=1000", "actor_rollout_ref.actor.optim.lr=1e-6",
        f"actor_rollout_ref.model.enable_gradient_checkpointing={str(args.gradient_checkpointing).lower()}",
    ]
    config = compose_config(overrides)
    pool = RayResourcePool([workers], use_gpu=use_gpu, name_prefix=f"bench{workers}")
    group = None
    try:
        group = RayWorkerGroup(pool, RayClassWithInitArgs(BenchActorWorker, config=config.actor_rollout_ref,
                                                          role="actor"))
        group.init_model()
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model_path).vocab_size
        data = make_batch(args.batch, args.prompt_length, args.response_length, vocab)
        data.union(group.compute_log_prob(data).select(batch_keys=["old_log_probs"]))
        times = []
        for i in range(args.iters + 1):
            start = time.perf_counter()
            group.update_actor(data)
            if i > 0:
                times.append(time.perf_counter() - start)
        tokens = args.batch * (args.prompt_length + args.response_length)
        seconds = statistics.median(times)
        return {"workers": workers, "tokens_per_update": tokens, "update_s": seconds,
                "tokens_per_s": tokens / seconds, "peak_memory_mib": max(group.peak_memory_mb())}
    finally:
        if group is not None:
            group.shutdown()
        pool.remove()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the set-ups of this machine (CPU or CUDA), print a table and write the JSON results."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=None, help="rows per update (default 32 on CPU, 64 on CUDA)")
    parser.add_argument("--micro-batch", type=int, default=8, help="rows per forward/backward")
    parser.add_argument("--prompt-length", type=int, default=None, help="default 96 on CPU, 960 on CUDA")
    parser.add_argument("--response-length", type=int, default=None, help="default 32 on CPU, 64 on CUDA")
    parser.add_argument("--iters", type=int, default=3, help="timed updates (after one warm-up)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/train_step.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    use_gpu = torch.cuda.is_available()
    defaults = (64, 960, 64) if use_gpu else (32, 96, 32)
    for name, value in zip(("batch", "prompt_length", "response_length"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    from utils.make_tiny_model import build_tiny_model

    ray.init(address="local", num_cpus=8, include_dashboard=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tiny = build_tiny_model(Path(tmp) / "tiny", seed=0)
            if use_gpu:
                model, params = build_qwen2_half_b(Path(tmp) / "qwen2_0.5b_shape", tiny)
                name = "qwen2-0.5b-shape (random, bf16)"
                worker_counts = [1, 2] if torch.cuda.device_count() >= 2 else [1]
            else:
                from transformers import AutoModelForCausalLM

                model, params = tiny, AutoModelForCausalLM.from_pretrained(tiny).num_parameters()
                name = "tiny qwen2 (fp32)"
                worker_counts = [1, 2]
            rows = [run_setup(model, w, use_gpu, args) for w in worker_counts]
    finally:
        ray.shutdown()
    gpu = torch.cuda.get_device_name(0) if use_gpu else None
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if gpu and k in gpu), None)
    for row in rows:
        row["mfu"] = 6 * params * row["tokens_per_s"] / (peak * row["workers"]) if peak else None
    result = {"model": name, "parameters": params, "device": gpu or platform.processor() or "cpu",
              "batch": args.batch, "micro_batch": args.micro_batch, "prompt_length": args.prompt_length,
              "response_length": args.response_length, "iters": args.iters, "results": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    lines = [f"{name}, {params / 1e6:.2f} M parameters, batch {args.batch} x {args.prompt_length}+"
             f"{args.response_length} tokens, device {result['device']}",
             f"{'workers':>7} | {'update s':>9} | {'tokens/s':>10} | {'peak MiB':>9} | {'MFU':>6}"]
    for row in rows:
        mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "n/a"
        lines.append(f"{row['workers']:>7} | {row['update_s']:>9.3f} | {row['tokens_per_s']:>10.0f} | "
                     f"{row['peak_memory_mib']:>9.0f} | {mfu:>6}")
    print("\n".join(lines))
    print(f"results written to {args.out}")
    return result


if __name__ == "__main__":
    main()
