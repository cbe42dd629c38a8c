"""A memory and time plan of a training configuration, before any GPU is touched.

    python -m verl.trainer.plan [--config-name sead_trainer] [--gpu-memory-gb 80] key=value ...

Reads the same config as ``verl.trainer.main_ppo`` (the YAML plus Hydra overrides, validated without checking the
data files or this machine's packages) and the model's ``config.json``, and prints for one GPU, phase by phase
(rollout, old log-probs, reference, values and critic update with GAE, actor update, and with the vLLM rollout the
weight sync after it) the estimated memory (sharded weights, gradients, optimizer states, gathered FSDP units,
activations, logits, KV cache, the vLLM engine, CUDA contexts) and a rough time, then the settings to change when a
phase does not fit. With ``rollout.name=vllm`` the rollout phase is the colocated engine's: the actor's resident
state beside ``gpu_memory_utilization`` of the GPU, and the engine's KV cache in tokens against the step's peak of
concurrent dialogue tokens. The offload keys move states off the GPU outside their phases. With LoRA
(``model.lora_rank``) a model's base is frozen in the compute dtype and only its adapter has master weights,
gradients and AdamW state; the actor's reference pass is the actor itself (adapter disabled) and its vLLM engine
keeps the base, receiving only the adapter (:mod:`verl.trainer.plan_lora`). The formulas are in
:mod:`verl.utils.memory_model`; the setup in :mod:`verl.trainer.plan_setup`, the phases in
:mod:`verl.trainer.plan_phases`, the advice in :mod:`verl.trainer.plan_advice`; this module prints them.
"""
from __future__ import annotations

import argparse
import sys

from omegaconf import OmegaConf

from verl.trainer.cli_overrides import check_overrides
from verl.trainer.config_schema import ConfigError, compose_config
from verl.trainer.config_validation import build_config, validate_config
from verl.trainer.plan_advice import advise
from verl.trainer.plan_lora import LoraPlan
from verl.trainer.plan_phases import build_phases
from verl.trainer.plan_setup import GB, Hardware, Phase, Setup, make_setup
from verl.utils import memory_model as mm

COLUMNS = ["weights", "optimizer", "gradients", "gathered units", "activations", "logits", "kv cache", "vllm",
           "cuda contexts"]


def _lora_line(name: str, lora: LoraPlan, shape: mm.ModelShape) -> str:
    """One line saying what a model's adapter covers and its size."""
    how = "" if name == "critic" else (", merged weights to vLLM" if lora.settings.merge else
                                        ", the adapter alone to vLLM")
    return (f"{name}: LoRA rank {lora.settings.rank} (alpha {lora.settings.alpha:g}) on {', '.join(lora.modules)}: "
            f"{count_text(lora.params)} trained parameters ({100 * lora.share(shape):.2f}% of the model), the base "
            f"frozen in the compute dtype{how}")


def count_text(n: float) -> str:
    """A parameter count with a unit that shows it: ``14.77B``, ``494.03M``, ``0.52M``."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def step_time_text(phases: list[Phase]) -> str:
    """A step's time: the phases' sum; with the rollout on GPUs of its own, also what overlapping it with training
    (``async_training``) would take, the longer of the two sides."""
    rollout = sum(p.seconds for p in phases if p.on_rollout_gpus) / 60
    training = sum(p.seconds for p in phases if not p.on_rollout_gpus) / 60
    if not any(p.on_rollout_gpus for p in phases):
        return f"about {training:.1f} min per step"
    return (f"about {rollout + training:.1f} min per step synchronously (the rollout {rollout:.1f} on its own GPUs, "
            f"then training {training:.1f}), about {max(rollout, training):.1f} with the two overlapped "
            "(async_training)")


def format_plan(s: Setup, hw: Hardware, phases: list[Phase], advice: list[str]) -> str:
    """The printed plan: the setup, one table row per phase (GB), the verdict, the notes and the advice."""
    vllm = s.cfg.actor_rollout_ref.rollout.name == "vllm"
    columns = [c for c in COLUMNS if c != "vllm" or vllm]
    gpus = f"{s.world} GPUs" + (f" for training + {s.rollout_gpus} for the rollout" if s.split else "")
    lines = [f"model: {count_text(s.actor.num_params())} parameters ({s.actor.num_layers} layers, hidden "
             f"{s.actor.hidden_size}, vocab {s.actor.vocab_size}); {gpus} of {hw.memory_bytes / GB:.0f} GB; "
             f"{s.rows_per_gpu} rows of {s.seq_len} tokens per GPU and step; compute dtype "
             f"{'bf16' if s.compute_bytes == 2 else 'fp32'}",
             *[_lora_line(name, lora, shape) for name, lora, shape in
               (("actor", s.actor_lora, s.actor), ("critic", s.critic_lora, s.critic)) if lora is not None],
             f"{'phase (per GPU, GB)':<34}" + "".join(f"{c[:11]:>12}" for c in columns) + f"{'total':>9}{'time':>10}"]
    for p in phases:
        cells = "".join(f"{p.memory.get(c, 0.0) / GB:>12.1f}" for c in columns)
        lines.append(f"{p.name:<34}{cells}{p.total / GB:>9.1f}{p.seconds / 60:>8.1f} m")
    worst = max(phases, key=lambda p: p.total)
    verdict = "fits" if worst.total <= hw.memory_bytes else "DOES NOT FIT"
    decode = (f"vLLM decoding at max(weights/TP + KV / {hw.hbm_tbps} TB/s, {hw.vllm_step_overhead_s * 1e3:.0f} ms)"
              if vllm else f"decoding at max(weights+KV / {hw.hbm_tbps} TB/s, "
              f"{hw.decode_step_overhead_s * 1e3:.0f} ms)")
    lines.append(f"peak {worst.total / GB:.1f} GB in '{worst.name}': {verdict} in {hw.memory_bytes / GB:.0f} GB; "
                 f"{step_time_text(phases)} (training at {hw.mfu:.0%} of {hw.bf16_tflops:.0f} TFLOP/s, "
                 f"{decode} per token)")
    lines += [f"  {note}" for p in phases for note in p.notes]
    lines += [f"  - {a}" for a in advice]
    return "\n".join(lines)


def plan(overrides: list[str], config_name: str = "ppo_trainer", hw: Hardware | None = None) -> str:
    """Compose and check the config, read the model shapes and return the printed plan."""
    hw = hw or Hardware()
    cfg = build_config(compose_config(overrides, config_name))
    validate_config(cfg, check_paths=False)
    if not cfg.actor_rollout_ref.model.path:
        raise ConfigError("actor_rollout_ref.model.path is required (a directory with the model's config.json)")
    actor = mm.ModelShape.from_model_dir(cfg.actor_rollout_ref.model.path)
    critic = mm.ModelShape.from_model_dir(cfg.critic.model.path or cfg.actor_rollout_ref.model.path) \
        if cfg.need_critic else None
    setup = make_setup(cfg, actor, critic)
    phases = build_phases(setup, hw)
    return format_plan(setup, hw, phases, advise(setup, hw, phases))


def main(argv: list[str] | None = None) -> None:
    """Command line: options, then Hydra ``key=value`` overrides."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-name", default="ppo_trainer", help="ppo_trainer | sead_trainer")
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0, help="usable memory of one GPU (GB)")
    parser.add_argument("--gpu-tflops", type=float, default=989.0, help="dense bf16 TFLOP/s of one GPU")
    parser.add_argument("--mfu", type=float, default=0.4, help="fraction of the peak reached in training")
    parser.add_argument("--hbm-tbps", type=float, default=3.35, help="memory bandwidth (TB/s)")
    parser.add_argument("--decode-step-ms", type=float, default=30.0,
                        help="HF generate's per-token overhead (python, sampling, synced_gpus)")
    parser.add_argument("--vllm-step-ms", type=float, default=5.0, help="vLLM's per-step overhead")
    parser.add_argument("--host-gbps", type=float, default=Hardware.host_gbps,
                        help="host <-> GPU copies (GB/s; a LoRA engine's base wakes from host memory)")
    args, overrides = parser.parse_known_args(argv)
    hw = Hardware(memory_bytes=args.gpu_memory_gb * GB, bf16_tflops=args.gpu_tflops, mfu=args.mfu,
                  hbm_tbps=args.hbm_tbps, decode_step_overhead_s=args.decode_step_ms / 1e3,
                  vllm_step_overhead_s=args.vllm_step_ms / 1e3, host_gbps=args.host_gbps)
    try:
        base = OmegaConf.to_container(compose_config([], args.config_name), resolve=False)
        print(plan(check_overrides(overrides, base=base), args.config_name, hw))
    except (ConfigError, FileNotFoundError, KeyError) as exc:
        raise SystemExit(f"plan: {exc}") from None


if __name__ == "__main__":
    main(sys.argv[1:])