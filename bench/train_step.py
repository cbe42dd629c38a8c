"""Benchmark: throughput and peak memory of the actor update (``update_actor``) on real FSDP workers.

    python -m bench.train_step [--batch B] [--prompt-length P] [--response-length R] [--iters 3]
                               [--out bench/results/train_step.json]
    python -m bench.train_step --long-dialogues [--batch B] [--micro-batch 4] [--max-token-len 16384]
                               [--out bench/results/train_step_long.json]

On CPU: the tiny Qwen2 model (``utils/make_tiny_model.py``) with 1 and 2 FSDP2 workers on gloo. On CUDA: a
Qwen2-0.5B-shaped model with random weights in bf16 on 1 and (if present) 2 GPUs, with the model-FLOPs
utilisation (6 x parameters x tokens per second over the GPU's dense bf16 peak). Each set-up starts an
``ActorRolloutRefWorker`` group (role ``actor``), computes real old log-probs once, then times
``--iters`` PPO updates (one optimizer step each) after one warm-up update. Tokens are the attended prompt +
response tokens (padding is not counted).

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


def run_setup(
    model_path: Path, workers: int, use_gpu: bool, args: argparse.Namespace, data: DataProto | None = None,
    extra_overrides: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Start a worker group, time ``args.iters`` actor updates of ``data`` (default: a random full-length batch)
    and one log-prob pass; return tokens/s and peak memory."""
    overrides = [
        f"actor_rollout_ref.model.path={model_path}", f"data.train_batch_size={args.batch}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro_batch}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.micro_batch}",
        f"data.max_prompt_length={args.prompt_length}", f"data.max_response_length={args.response_length}",
        "actor_rollout_ref.actor.optim.total_training_steps=1000", "actor_rollout_ref.actor.optim.lr=1e-6",
        f"actor_rollout_ref.model.enable_gradient_checkpointing={str(args.gradient_checkpointing).lower()}",
        *extra_overrides,
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
        if data is None:
            data = make_batch(args.batch, args.prompt_length, args.response_length, vocab)
        data = copy.deepcopy(data)  # the caller's batch stays without old_log_probs
        data = data.union(group.compute_log_prob(data).select(batch_keys=["old_log_probs"]))
        start = time.perf_counter()
        group.compute_log_prob(data)
        log_prob_s = time.perf_counter() - start
        times = []
        for i in range(args.iters + 1):
            start = time.perf_counter()
            group.update_actor(data)
            if i > 0:
                times.append(time.perf_counter() - start)
        tokens = int(data.batch["attention_mask"].sum())
        seconds = statistics.median(times)
        return {"workers": workers, "tokens_per_update": tokens, "update_s": seconds, "update_s_all": times,
                "tokens_per_s": tokens / seconds, "log_prob_s": log_prob_s,
                "log_prob_tokens_per_s": tokens / log_prob_s,
                "peak_memory_mib": max(group.peak_memory_mb())}
    finally:
        if group is not None:
            group.shutdown()
        pool.remove()


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


def _print_table(name: str, params: int, result: dict[str, Any]) -> None:
    """The result rows as a console table."""
    shape = (f"lengths {result['lengths']}" if "lengths" in result
             else f"{result['prompt_length']}+{result['response_length']} tokens")
    lines = [f"{name}, {params / 1e6:.2f} M parameters, batch {result['batch']}, {shape}, device {result['device']}",
             f"{'setup':>15} | {'workers':>7} | {'update s':>9} | {'tokens/s':>10} | {'log-prob s':>10} | "
             f"{'peak MiB':>9} | {'MFU':>6}"]
    for row in result["results"]:
        mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "n/a"
        lines.append(f"{row.get('setup', 'padded+fixed'):>15} | {row['workers']:>7} | {row['update_s']:>9.3f} | "
                     f"{row['tokens_per_s']:>10.0f} | {row['log_prob_s']:>10.3f} | {row['peak_memory_mib']:>9.0f} | "
                     f"{mfu:>6}")
    if "throughput_ratio" in result:
        lines.append(f"packed+dynamic / padded+fixed: update tokens/s x{result['throughput_ratio']:.2f}, log-prob "
                     f"x{result['log_prob_throughput_ratio']:.2f}, peak memory x{result['peak_memory_ratio']:.2f}")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the set-ups of this machine (CPU or CUDA), print a table and write the JSON results."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=None,
                        help="rows per update (default 32 on CPU, 64 on CUDA; long dialogues: 16 / 64)")
    parser.add_argument("--micro-batch", type=int, default=None, help="rows per forward/backward (default 8; "
                        "long dialogues: 4)")
    parser.add_argument("--prompt-length", type=int, default=None, help="default 96 on CPU, 960 on CUDA; "
                        "long dialogues: 256 (prompt width)")
    parser.add_argument("--response-length", type=int, default=None, help="default 32 on CPU, 64 on CUDA; "
                        "long dialogues: 3840 (conversation width)")
    parser.add_argument("--iters", type=int, default=3, help="timed updates (after one warm-up)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--long-dialogues", action="store_true", help="padded+fixed vs packed+dynamic on a batch "
                        "of skewed call lengths (256-4096 tokens)")
    parser.add_argument("--max-token-len", type=int, default=16384,
                        help="packed+dynamic: ppo_max_token_len_per_gpu (tokens per micro-batch)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default bench/results/train_step.json (long dialogues: train_step_long.json)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    use_gpu = torch.cuda.is_available()
    if args.long_dialogues:
        defaults = (64 if use_gpu else 16, 4, 256, 3840)
    else:
        defaults = (64, 8, 960, 64) if use_gpu else (32, 8, 96, 32)
    for name, value in zip(("batch", "micro_batch", "prompt_length", "response_length"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.out is None:
        args.out = REPO / "bench/results" / ("train_step_long.json" if args.long_dialogues else "train_step.json")
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
            if args.long_dialogues:
                result = run_long_dialogues(model, use_gpu, args)
            else:
                result = {"results": [run_setup(model, w, use_gpu, args) for w in worker_counts]}
    finally:
        ray.shutdown()
    gpu = torch.cuda.get_device_name(0) if use_gpu else None
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if gpu and k in gpu), None)
    for row in result["results"]:
        row["mfu"] = 6 * params * row["tokens_per_s"] / (peak * row["workers"]) if peak else None
    result = {"model": name, "parameters": params, "device": gpu or platform.processor() or "cpu",
              "batch": args.batch, "micro_batch": args.micro_batch, "prompt_length": args.prompt_length,
              "response_length": args.response_length, "iters": args.iters, **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    _print_table(name, params, result)
    print(f"results written to {args.out}")
    return result


if __name__ == "__main__":
    main()
