"""A memory and time plan of a training configuration, before any GPU is touched.

    python -m verl.trainer.plan [--config-name sead_trainer] [--gpu-memory-gb 80] key=value ...

Reads the same config as ``verl.trainer.main_ppo`` (the YAML plus Hydra overrides, validated without checking the
data files) and the model's ``config.json``, and prints for one GPU, phase by phase (rollout, old log-probs,
reference, values and critic update with GAE, actor update) the estimated memory (sharded weights, gradients,
optimizer states, gathered FSDP units, activations, logits, KV cache, CUDA contexts) and a rough time, then the
settings to change when a phase does not fit. The formulas are in :mod:`verl.utils.memory_model`.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

from omegaconf import OmegaConf

from verl.trainer.cli_overrides import check_overrides
from verl.trainer.config_schema import ConfigError, PPOTrainerConfig, compose_config
from verl.trainer.config_validation import build_config, validate_config
from verl.utils import memory_model as mm

GB = 1e9
CONTEXT_BYTES = 1 * mm.GIB  # CUDA context + NCCL buffers of one process (measured 0.5-1 GiB on H100s)
ADAMW_STEP_TEMPORARIES = 1  # the foreach AdamW step allocates about one fp32 copy of the local shard


@dataclass
class Hardware:
    """The GPU the plan is for."""

    memory_bytes: float = 80 * GB
    bf16_tflops: float = 989.0
    mfu: float = 0.4
    hbm_tbps: float = 3.35
    decode_step_overhead_s: float = 0.03


@dataclass
class Phase:
    """Memory (bytes, by component) and time (seconds) of one phase on one GPU."""

    name: str
    memory: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    advice: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        """Sum of the components."""
        return sum(self.memory.values())


@dataclass
class Setup:
    """What the phases need from the config and the model shapes."""

    cfg: PPOTrainerConfig
    actor: mm.ModelShape
    critic: mm.ModelShape | None
    world: int
    compute_bytes: int
    rows_per_gpu: int
    seq_len: int
    response_len: int
    prompt_len: int
    decode_steps: int


def _dtype_bytes(param_dtype: str) -> int:
    """Compute dtype bytes of ``fsdp_config.param_dtype`` on CUDA (auto = bf16)."""
    return 4 if param_dtype in ("fp32", "float32") else 2


def make_setup(cfg: PPOTrainerConfig, actor: mm.ModelShape, critic: mm.ModelShape | None) -> Setup:
    """The per-GPU quantities of a validated config."""
    data, rollout = cfg.data, cfg.actor_rollout_ref.rollout
    loop = cfg.rollout_loop.config or {}
    if cfg.rollout_loop.path and "max_turns" in loop and "max_tokens_per_turn" in loop:
        decode_steps = int(loop["max_turns"]) * int(loop["max_tokens_per_turn"])
    else:
        decode_steps = data.max_response_length
    rows = data.train_batch_size * rollout.n
    return Setup(cfg=cfg, actor=actor, critic=critic, world=cfg.world_size,
                 compute_bytes=_dtype_bytes(cfg.actor_rollout_ref.actor.fsdp_config.param_dtype),
                 rows_per_gpu=-(-rows // cfg.world_size), seq_len=data.max_prompt_length + data.max_response_length,
                 response_len=data.max_response_length, prompt_len=data.max_prompt_length,
                 decode_steps=min(decode_steps, data.max_response_length))


def _states(s: Setup) -> dict[str, mm.ShardedState]:
    """Sharded state of every model on the GPU (actor, reference in the compute dtype, critic)."""
    b, separate = s.compute_bytes, s.cfg.actor_rollout_ref.actor.strategy == "fsdp2"
    states = {"actor": mm.sharded_state(s.actor, s.world, b, mm.FP32, True, separate_embedding_units=separate)}
    if s.cfg.need_reference:
        states["ref"] = mm.sharded_state(s.actor, s.world, b, b, False, separate_embedding_units=separate)
    if s.critic is not None:
        states["critic"] = mm.sharded_state(s.critic, s.world, _dtype_bytes(s.cfg.critic.fsdp_config.param_dtype),
                                            mm.FP32, True, value_head=True,
                                            separate_embedding_units=s.cfg.critic.strategy == "fsdp2")
    return states


def _resident(states: dict[str, mm.ShardedState]) -> dict[str, float]:
    """Bytes held on the GPU in every phase: master shards, optimizer states, one CUDA context per process."""
    memory = {"weights": float(sum(st.params for st in states.values())),
              "optimizer": float(sum(st.optimizer for st in states.values()))}
    memory["cuda contexts"] = CONTEXT_BYTES * (2.0 if "critic" in states else 1.0)
    return memory


def _head_positions(s: Setup, value_head: bool) -> int | None:
    """Positions through the head per GPU: the actor's are the response positions, a value head sees all."""
    return None if value_head else s.rows_per_gpu * (s.response_len + 1)


def _time_forward(s: Setup, hw: Hardware, shape: mm.ModelShape, value_head: bool = False) -> float:
    flops = mm.forward_flops(shape, s.rows_per_gpu, s.seq_len, value_head, _head_positions(s, value_head))
    return flops / (hw.bf16_tflops * 1e12 * hw.mfu)


def rollout_phase(s: Setup, hw: Hardware, micro: int) -> Phase:
    """HF generation: the whole policy gathered once per generate call, the KV cache of one micro-batch."""
    states = _states(s)
    b, shape = s.compute_bytes, s.actor
    phase = Phase("rollout (HF generate)", _resident(states))
    fsdp2 = s.cfg.actor_rollout_ref.actor.strategy == "fsdp2"  # FSDP2 keeps the whole model gathered, FSDP1 a unit
    phase.memory["gathered units"] = float(shape.num_params() * b if fsdp2 else states["actor"].gathered)
    phase.memory["kv cache"] = float(mm.kv_cache_bytes(shape, micro, s.seq_len, b))
    # prefill: a multi-turn loop re-reads the whole dialogue each turn (up to the full sequence), one turn the prompt
    prefill = s.seq_len if s.cfg.rollout_loop.path else s.prompt_len
    phase.memory["activations"] = float(micro * prefill * shape.forward_transient_bytes_per_token(b))
    phase.memory["logits"] = float(micro * shape.vocab_size * mm.FP32 * 2)
    calls = -(-s.rows_per_gpu // micro)
    step_bytes = shape.num_params() * b + mm.kv_cache_bytes(shape, micro, s.seq_len // 2, b)
    step_s = max(step_bytes / (hw.hbm_tbps * 1e12), hw.decode_step_overhead_s)
    phase.seconds = calls * s.decode_steps * step_s
    return phase


def forward_phase(s: Setup, hw: Hardware, name: str, model: str, micro: int) -> Phase:
    """A no-grad forward over this GPU's rows (old log-probs, reference log-probs or values)."""
    states = _states(s)
    critic = model == "critic"
    shape = s.critic if critic else s.actor
    b = _dtype_bytes(s.cfg.critic.fsdp_config.param_dtype) if critic else s.compute_bytes
    peak = mm.forward_pass_peak(shape, micro, s.seq_len, s.response_len, b, with_logits=not critic,
                                head_positions=s.response_len + 1)  # the actor's head sees response positions only
    phase = Phase(name, _resident(states))
    phase.memory["gathered units"] = float(states[model].gathered)
    phase.memory["activations"] = float(peak.activations)
    phase.memory["logits"] = float(peak.logits)
    phase.seconds = _time_forward(s, hw, shape, critic)
    return phase


def update_phase(s: Setup, hw: Hardware, model: str, micro: int, checkpointing: bool) -> Phase:
    """A training pass over this GPU's rows: gradients, one micro-batch's activations, the optimizer step."""
    states = _states(s)
    critic = model == "critic"
    shape = s.critic if critic else s.actor
    b = _dtype_bytes(s.cfg.critic.fsdp_config.param_dtype) if critic else s.compute_bytes
    attn = (s.cfg.actor_rollout_ref.model.attn_implementation)
    peak = mm.update_pass_peak(shape, micro, s.seq_len, s.response_len, b, checkpointing,
                               repeat_kv=attn != "flash_attention_2", head_positions=s.response_len + 1)
    if critic:  # the value head's output is one number per position
        peak = mm.PassPeak(activations=peak.activations, logits=micro * s.seq_len * mm.FP32)
    phase = Phase(f"update {model}" + (" (checkpointing)" if checkpointing else ""), _resident(states))
    phase.memory["gradients"] = float(states[model].grads)
    step = ADAMW_STEP_TEMPORARIES * states[model].params
    pass_bytes = states[model].gathered + peak.total
    phase.memory["gathered units"] = float(states[model].gathered) if pass_bytes >= step else 0.0
    phase.memory["activations"] = float(peak.activations) if pass_bytes >= step else float(step)
    phase.memory["logits"] = float(peak.logits) if pass_bytes >= step else 0.0
    flops = mm.training_flops(shape, s.rows_per_gpu, s.seq_len, checkpointing, critic, _head_positions(s, critic))
    phase.seconds = flops / (hw.bf16_tflops * 1e12 * hw.mfu)
    return phase


def build_phases(s: Setup, hw: Hardware) -> list[Phase]:
    """Every phase of one training step, in the order the trainer runs them."""
    a = s.cfg.actor_rollout_ref
    ckpt = a.model.enable_gradient_checkpointing
    phases = [rollout_phase(s, hw, a.rollout.micro_batch_size_per_gpu),
              forward_phase(s, hw, "old log-probs", "actor", a.rollout.log_prob_micro_batch_size_per_gpu)]
    if s.cfg.need_reference:
        phases.append(forward_phase(s, hw, "reference log-probs", "ref", a.ref.log_prob_micro_batch_size_per_gpu))
    if s.critic is not None:
        c = s.cfg.critic
        phases.append(forward_phase(s, hw, "values (critic)", "critic", c.forward_micro_batch_size_per_gpu))
        phases.append(update_phase(s, hw, "critic", c.ppo_micro_batch_size_per_gpu,
                                   c.model.enable_gradient_checkpointing))
    phases.append(update_phase(s, hw, "actor", a.actor.ppo_micro_batch_size_per_gpu, ckpt))
    return phases


def _largest_fitting(build, current: int, limit: float) -> int:
    """The largest micro-batch <= ``current`` whose phase fits in ``limit`` bytes (0 if none does)."""
    for micro in range(current, 0, -1):
        if build(micro).total <= limit:
            return micro
    return 0


def advise(s: Setup, hw: Hardware, phases: list[Phase]) -> list[str]:
    """Settings to change for the phases that do not fit in ``hw.memory_bytes``."""
    a, limit, advice = s.cfg.actor_rollout_ref, hw.memory_bytes, []
    resident = sum(_resident(_states(s)).values())
    if resident > limit:
        advice.append(f"the sharded weights and optimizer states alone need {resident / GB:.1f} GB per GPU: raise "
                      f"trainer.n_gpus_per_node / trainer.nnodes (now {s.world} GPUs), or offload parameters and "
                      "optimizer states to the CPU (fsdp_config.param_offload / optimizer_offload)")
        return advice
    knobs = {
        "rollout": ("actor_rollout_ref.rollout.micro_batch_size_per_gpu", a.rollout.micro_batch_size_per_gpu,
                    lambda m: rollout_phase(s, hw, m)),
        "old": ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                a.rollout.log_prob_micro_batch_size_per_gpu,
                lambda m: forward_phase(s, hw, "", "actor", m)),
        "reference": ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
                      a.ref.log_prob_micro_batch_size_per_gpu, lambda m: forward_phase(s, hw, "", "ref", m)),
        "values": ("critic.forward_micro_batch_size_per_gpu", s.cfg.critic.forward_micro_batch_size_per_gpu,
                   lambda m: forward_phase(s, hw, "", "critic", m)),
    }
    for phase in phases:
        if phase.total <= limit:
            continue
        head = phase.name.split()[0]
        if head == "update":
            model = phase.name.split()[1]
            ckpt = (s.cfg.critic.model if model == "critic" else a.model).enable_gradient_checkpointing
            prefix = "critic" if model == "critic" else "actor_rollout_ref"
            micro_key = "critic" if model == "critic" else "actor_rollout_ref.actor"
            micro_now = (s.cfg.critic if model == "critic" else a.actor).ppo_micro_batch_size_per_gpu
            if not ckpt and update_phase(s, hw, model, micro_now, True).total <= limit:
                advice.append(f"{phase.name}: set {prefix}.model.enable_gradient_checkpointing=true")
                continue
            fit = _largest_fitting(lambda m: update_phase(s, hw, model, m, True), micro_now, limit)
            if fit:
                advice.append(f"{phase.name}: set {prefix}.model.enable_gradient_checkpointing=true and "
                              f"{micro_key}.ppo_micro_batch_size_per_gpu={fit}")
                continue
            advice.append(f"{phase.name}: one row of {s.seq_len} tokens does not fit even with checkpointing: "
                          "shorten data.max_prompt_length / max_response_length, add GPUs, or offload the "
                          "optimizer (fsdp_config.optimizer_offload)")
            continue
        key, now, build = knobs[head]
        fit = _largest_fitting(build, now, limit)
        critic_hint = ("; or keep the critic off the GPU outside its phases (critic.model.fsdp_config.param_offload "
                       "/ optimizer_offload)") if s.critic is not None and head != "values" else ""
        if fit:
            advice.append(f"{phase.name}: set {key}={fit} (now {now}){critic_hint}")
        else:
            advice.append(f"{phase.name}: does not fit even with 1 row per micro-batch: add GPUs or shorten the "
                          "sequences")
    return advice


def format_plan(s: Setup, hw: Hardware, phases: list[Phase], advice: list[str]) -> str:
    """The printed plan: the setup, one table row per phase (GB), the verdict and the advice."""
    columns = ["weights", "optimizer", "gradients", "gathered units", "activations", "logits", "kv cache",
               "cuda contexts"]
    lines = [f"model: {s.actor.num_params() / 1e9:.2f}B parameters ({s.actor.num_layers} layers, hidden "
             f"{s.actor.hidden_size}, vocab {s.actor.vocab_size}); {s.world} GPUs of {hw.memory_bytes / GB:.0f} GB; "
             f"{s.rows_per_gpu} rows of {s.seq_len} tokens per GPU and step; compute dtype "
             f"{'bf16' if s.compute_bytes == 2 else 'fp32'}",
             f"{'phase (per GPU, GB)':<34}" + "".join(f"{c[:11]:>12}" for c in columns) + f"{'total':>9}{'time':>10}"]
    for p in phases:
        cells = "".join(f"{p.memory.get(c, 0.0) / GB:>12.1f}" for c in columns)
        lines.append(f"{p.name:<34}{cells}{p.total / GB:>9.1f}{p.seconds / 60:>8.1f} m")
    worst = max(phases, key=lambda p: p.total)
    total_min = sum(p.seconds for p in phases) / 60
    verdict = "fits" if worst.total <= hw.memory_bytes else "DOES NOT FIT"
    lines.append(f"peak {worst.total / GB:.1f} GB in '{worst.name}': {verdict} in {hw.memory_bytes / GB:.0f} GB; "
                 f"about {total_min:.1f} min per step (training at {hw.mfu:.0%} of {hw.bf16_tflops:.0f} TFLOP/s, "
                 f"decoding at max(weights+KV / {hw.hbm_tbps} TB/s, {hw.decode_step_overhead_s * 1e3:.0f} ms) per "
                 "token)")
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
    args, overrides = parser.parse_known_args(argv)
    hw = Hardware(memory_bytes=args.gpu_memory_gb * GB, bf16_tflops=args.gpu_tflops, mfu=args.mfu,
                  hbm_tbps=args.hbm_tbps, decode_step_overhead_s=args.decode_step_ms / 1e3)
    try:
        base = OmegaConf.to_container(compose_config([], args.config_name), resolve=False)
        print(plan(check_overrides(overrides, base=base), args.config_name, hw))
    except (ConfigError, FileNotFoundError, KeyError) as exc:
        raise SystemExit(f"plan: {exc}") from None


if __name__ == "__main__":
    main(sys.argv[1:])
