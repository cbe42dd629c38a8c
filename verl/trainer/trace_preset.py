"""The real shapes without a GPU: one training step of a config traced at full size on CPU, side by side with the
memory planner.

    python -m verl.trainer.trace_preset [--config-name sead_trainer] key=value ...

Reads the config as ``python -m verl.trainer.plan`` does (the model directory needs only its ``config.json``),
builds the workers' models for one rank of ``trainer.n_gpus_per_node x nnodes`` (:mod:`verl.trainer.trace_models`:
a fake process group, fake tensors, FSDP2 wrapping, mixed precision, activation checkpointing, LoRA, the packed
attention) and runs the step's phases at the config's largest micro-batch (:mod:`verl.trainer.trace_phases`),
counting every tensor's storage (:mod:`verl.utils.memory_trace`). It prints, per phase, the planner's and the
trace's bytes of weights, optimizer state, gradients, gathered FSDP units, activations and logits, their peak, the
dtypes of each group and the collectives issued, then the weight sync's buckets; it exits 1 naming the line items
that differ by more than :data:`TOLERANCE` (:mod:`verl.trainer.trace_report`). The rollout's vLLM engine, the KV
cache and the CUDA contexts are the planner's alone.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf

from verl.trainer.cli_overrides import check_overrides
from verl.trainer.config_schema import ConfigError, compose_config
from verl.trainer.config_validation import build_config, validate_config
from verl.trainer.plan_phases import build_phases
from verl.trainer.plan_setup import Hardware, Phase, Setup, make_setup
from verl.trainer.trace_models import build_models, fake_world, worker_section
from verl.trainer.trace_phases import MicroBatchShape, StepSettings, micro_batch_shape, trace_step
from verl.trainer.trace_report import TraceReport, compare
from verl.utils import memory_model as mm
from verl.utils.logging_setup import configure_logging
from verl.utils.memory_trace import MemoryTrace


@dataclass
class TraceResult:
    """A traced step and the planner's phases for the same config."""

    setup: Setup
    trace: MemoryTrace
    settings: StepSettings
    plan: dict[str, Phase]
    report: TraceReport


def _shape(s: Setup, rows: int | None, dynamic: bool, budget: int, packed: bool) -> MicroBatchShape:
    """A pass's largest micro-batch: ``rows`` rows, or with ``dynamic`` a ``budget`` of tokens."""
    return micro_batch_shape(s.seq_len, s.response_len, int(rows or 1), budget if dynamic else None, packed)


def _several_micro_batches(s: Setup, mini_batch: int, micro_rows: int | None, dynamic: bool,
                           budget: int) -> bool:
    """Whether a mini-batch of ``mini_batch`` prompts (x rollout.n rows over the world) takes more than one
    micro-batch on a rank (full-length rows against a token budget)."""
    rows = -(-mini_batch * s.cfg.actor_rollout_ref.rollout.n // s.world)
    if dynamic:
        return rows * s.seq_len > budget
    return rows > int(micro_rows or 1)


def step_settings(s: Setup, actor_cfg: DictConfig, critic_cfg: DictConfig | None) -> StepSettings:
    """The passes' micro-batches and the offload keys of ``s``'s config; ``actor_cfg`` / ``critic_cfg`` are the
    workers' sections (the loss and clipping settings)."""
    a, c = s.cfg.actor_rollout_ref, s.cfg.critic
    packed = a.model.use_remove_padding
    log_rows = a.rollout.log_prob_micro_batch_size_per_gpu or a.actor.ppo_micro_batch_size_per_gpu
    ref_rows = a.ref.log_prob_micro_batch_size_per_gpu or a.actor.ppo_micro_batch_size_per_gpu
    settings = StepSettings(
        world=s.world,
        log_prob=_shape(s, log_rows, a.rollout.log_prob_use_dynamic_bsz, a.rollout.log_prob_max_token_len_per_gpu,
                        packed),
        ref_log_prob=_shape(s, ref_rows, a.ref.log_prob_use_dynamic_bsz, a.ref.log_prob_max_token_len_per_gpu,
                            packed),
        update=_shape(s, a.actor.ppo_micro_batch_size_per_gpu, a.actor.use_dynamic_bsz,
                      a.actor.ppo_max_token_len_per_gpu, packed),
        actor_section=actor_cfg.actor,
        param_offload={"actor": a.actor.fsdp_config.param_offload, "ref": a.ref.fsdp_config.param_offload,
                       "critic": c.model.fsdp_config.param_offload},
        optimizer_offload={"actor": a.actor.fsdp_config.optimizer_offload,
                           "critic": c.model.fsdp_config.optimizer_offload},
        weight_dtype=torch.bfloat16 if s.compute_bytes == 2 else torch.float32,
        bucket_bytes=int(a.rollout.update_weights_bucket_megabytes * 2**20), sync_weights=s.vllm,
        accumulate=_several_micro_batches(s, a.actor.ppo_mini_batch_size, a.actor.ppo_micro_batch_size_per_gpu,
                                          a.actor.use_dynamic_bsz, a.actor.ppo_max_token_len_per_gpu))
    if s.critic is not None:
        critic_packed = c.model.use_remove_padding
        settings.critic_values = _shape(s, c.forward_micro_batch_size_per_gpu, c.use_dynamic_bsz,
                                        c.forward_max_token_len_per_gpu, critic_packed)
        settings.critic_update = _shape(s, c.ppo_micro_batch_size_per_gpu, c.use_dynamic_bsz,
                                        c.ppo_max_token_len_per_gpu, critic_packed)
        settings.critic_section = critic_cfg
        settings.critic_accumulate = _several_micro_batches(s, c.ppo_mini_batch_size, c.ppo_micro_batch_size_per_gpu,
                                                            c.use_dynamic_bsz, c.ppo_max_token_len_per_gpu)
    return settings


def trace_preset(overrides: list[str], config_name: str = "ppo_trainer",
                 hardware: Hardware | None = None) -> TraceResult:
    """Compose and check the config, trace its step and compare it with the planner's phases."""
    raw = compose_config(overrides, config_name)
    cfg = build_config(raw)
    validate_config(cfg, check_paths=False)
    model_path = cfg.actor_rollout_ref.model.path
    if not model_path:
        raise ConfigError("actor_rollout_ref.model.path is required (a directory with the model's config.json)")
    critic_path = cfg.critic.model.path or model_path
    actor_shape = mm.ModelShape.from_model_dir(model_path)
    critic_shape = mm.ModelShape.from_model_dir(critic_path) if cfg.need_critic else None
    setup = make_setup(cfg, actor_shape, critic_shape)
    hardware = hardware or Hardware()
    plan_phases = {p.name.split(" (")[0]: p for p in build_phases(setup, hardware)}
    actor_cfg = worker_section(raw.actor_rollout_ref)
    critic_cfg = worker_section(raw.critic) if cfg.need_critic else None
    settings = step_settings(setup, actor_cfg, critic_cfg)
    trace = MemoryTrace(logits_width=actor_shape.vocab_size)
    with fake_world(setup.world) as mesh:
        models = build_models(mesh, actor_cfg, critic_cfg, model_path, cfg.need_reference, critic_path)
        with trace:
            trace_step(trace, models, settings)
    report = compare(setup, trace, settings.received, plan_phases, settings.weight_dtype)
    return TraceResult(setup, trace, settings, plan_phases, report)


def main(argv: list[str] | None = None) -> None:
    """Command line: options, then Hydra ``key=value`` overrides; exit 1 when the trace and the plan differ."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-name", default="ppo_trainer", help="ppo_trainer | sead_trainer")
    args, overrides = parser.parse_known_args(argv)
    configure_logging(os.environ.get("SEAD_LOG_LEVEL") or "WARNING")  # the report is the output
    try:
        base = OmegaConf.to_container(compose_config([], args.config_name), resolve=False)
        result = trace_preset(check_overrides(overrides, base=base), args.config_name)
    except (ConfigError, FileNotFoundError, KeyError) as exc:
        raise SystemExit(f"trace_preset: {exc}") from None
    print(result.report.format())
    if result.report.differences:
        raise SystemExit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
