"""Benchmark: the policy's rollout engines, HF generate vs vLLM, on the same multi-turn contexts, and the weight sync.

    python -m bench.rollout_engine [--shape tiny|qwen2-0.5b] [--dialogues 32] [--turns 4] [--response-length 32]
                                   [--repeats 3] [--out bench/results/rollout_engine.json]

Needs vLLM in the running Python (`.venv-vllm/bin/python -m bench.rollout_engine`). One process holds a 1-rank
torch.distributed group (gloo on CPU, nccl on CUDA), as an actor-rollout worker does, and both engines the
trainer uses: `HFRollout` on the FSDP2-wrapped model and `vLLMRollout` fed that model's weights through the
in-memory sync (`fsdp_weight_stream` -> vLLM's `reload_weights`). The contexts are scripted SEAD calls
(`utils.sft_warm_start.scripted_dialogues`, rendered with the chat template): one `generate_sequences` call per
agent turn over all dialogues, each call's contexts being the call transcripts up to that turn, as the rollout
loop builds them (later turns re-send the earlier ones: vLLM's prefix cache can reuse them). Sampling at
temperature 1 with the tokenizer's EOS; throughput counts the tokens actually generated (response_mask).

`--shape tiny` is the test model (random, 140k parameters, fp32 on CPU); `--shape qwen2-0.5b` is a random model of
Qwen2-0.5B's shape (24 layers, hidden 896, 14 heads / 2 KV heads, vocabulary 151936, tied embeddings), in bf16
on CUDA and fp32 on CPU, with the tiny tokenizer. Reported per engine: median seconds per call sequence and
tokens/s over `--repeats` runs (after one warm-up), and the vLLM/HF ratio; for the sync, median seconds and MiB.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from utils.make_tiny_model import build_tiny_model
from llm_agent.scenario import DEFAULT_SCENARIO_PATH, load_scenario
from verl.protocol import DataProto
from verl.utils.fsdp_utils import build_fsdp_model, create_device_mesh
from verl.utils.torch_functional import compute_position_id_with_mask

logger = logging.getLogger("bench.rollout_engine")
REPO = Path(__file__).resolve().parents[1]
SCENARIO = DEFAULT_SCENARIO_PATH
QWEN2_05B = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
             "tie_word_embeddings": True, "rope_theta": 1000000.0}


def build_model(shape: str, out: Path) -> Path:
    """The tiny model, or a random Qwen2-0.5B-shaped model with the tiny tokenizer, saved under ``out``."""
    tiny = build_tiny_model(out / "tiny", seed=0)
    if shape == "tiny":
        return Path(tiny)
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    config = Qwen2Config(**QWEN2_05B, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out / "qwen2-0.5b")
    tokenizer.save_pretrained(out / "qwen2-0.5b")
    return out / "qwen2-0.5b"


def turn_batches(tokenizer, dialogues: int, turns: int, context_cap: int) -> list[DataProto]:
    """One left-padded batch per agent turn: every dialogue's transcript up to that turn (last `context_cap`
    tokens), ending with the assistant prompt."""
    from utils.sft_warm_start import scripted_dialogues

    calls = scripted_dialogues(SCENARIO, dialogues, {"good": 1.0}, seed=0, max_turns=turns,
                               system_prompt=load_scenario(SCENARIO).agent_compact_prompt)
    batches = []
    for turn in range(1, turns + 1):
        rows = []
        for messages in calls:
            assistant_at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
            cut = assistant_at[turn - 1] if turn <= len(assistant_at) else len(messages)
            text = tokenizer.apply_chat_template(messages[:cut], add_generation_prompt=True, tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            rows.append(ids[-context_cap:])
        width = max(len(r) for r in rows)
        input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        batches.append(DataProto.from_dict(
            tensors={"input_ids": input_ids, "attention_mask": mask,
                     "position_ids": compute_position_id_with_mask(mask)},
            meta_info={"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}))
    return batches


def run_calls(rollout, batches: list[DataProto], seed: int) -> tuple[float, int]:
    """Seconds and generated tokens of one generate_sequences call per turn batch."""
    torch.manual_seed(seed)
    start, tokens = time.perf_counter(), 0
    for batch in batches:
        tokens += int(rollout.generate_sequences(batch).batch["response_mask"].sum())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, tokens


def _init_group(device: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=["tiny", "qwen2-0.5b"], default="tiny")
    parser.add_argument("--dialogues", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--context-cap", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "bench/results/rollout_engine.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from verl.workers.rollout.hf_rollout import HFRollout
    from verl.workers.rollout.vllm_rollout import WeightSyncStats, fsdp_weight_stream, vLLMRollout

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    _init_group(device)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(args.shape, Path(tmp))
        tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
        batches = turn_batches(tokenizer, args.dialogues, args.turns, args.context_cap)
        longest = max(b.batch["input_ids"].size(1) for b in batches)
        module = build_fsdp_model(Qwen2ForCausalLM, str(model_dir), create_device_mesh(device),
                                  {"param_dtype": "bf16" if device == "cuda" else "fp32"}, seed=0)
        config = OmegaConf.create({
            "do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "response_length": args.response_length,
            "prompt_length": longest, "micro_batch_size_per_gpu": args.dialogues, "tensor_model_parallel_size": 1,
            "gpu_memory_utilization": 0.3, "max_num_seqs": max(args.dialogues, 8), "max_num_batched_tokens": 8192,
            "enforce_eager": True, "enable_prefix_caching": True, "seed": 0, "free_cache_engine": False})
        hf = HFRollout(module, config)
        engine_start = time.perf_counter()
        vllm = vLLMRollout(str(model_dir), config, dtype, device)
        engine_s = time.perf_counter() - engine_start
        syncs = []
        for _ in range(args.repeats + 1):
            stats = WeightSyncStats()
            vllm.update_weights(fsdp_weight_stream(module, vllm.weight_dtype, stats), stats)
            syncs.append(stats)
        results = {}
        for name, rollout in (("hf", hf), ("vllm", vllm)):
            run_calls(rollout, batches[:1], seed=0)  # warm-up
            runs = [run_calls(rollout, batches, seed=r) for r in range(args.repeats)]
            seconds = statistics.median(s for s, _ in runs)
            tokens = statistics.median(t for _, t in runs)
            results[name] = {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}
            logger.info("%-5s %.2f s for %d calls, %d tokens: %.0f tokens/s", name, seconds, len(batches), tokens,
                        tokens / seconds)
    sync_s = statistics.median(s.seconds for s in syncs[1:])
    report = {
        "shape": args.shape, "device": device, "dtype": dtype, "dialogues": args.dialogues, "turns": args.turns,
        "response_length": args.response_length, "longest_context": longest, "engine_start_s": engine_s,
        **{f"{k}_{m}": v for k, r in results.items() for m, v in r.items()},
        "vllm_over_hf_tokens_per_s": results["vllm"]["tokens_per_s"] / results["hf"]["tokens_per_s"],
        "weight_sync_s": sync_s, "weight_sync_mib": syncs[-1].bytes / 2**20, "weight_sync_tensors": syncs[-1].tensors,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
                   f"{torch.cuda.get_device_name() if device == 'cuda' else 'no GPU'}, torch {torch.__version__}",
        "load_1min": os.getloadavg()[0],
    }
    logger.info("vLLM / HF tokens/s: %.2fx; weight sync %.3f s for %.1f MiB (%d tensors); engine start %.1f s",
                report["vllm_over_hf_tokens_per_s"], sync_s, report["weight_sync_mib"], report["weight_sync_tensors"],
                engine_s)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
