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
:mod:`verl.utils.memory_model`.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

from omegaconf import OmegaConf

from verl.trainer.cli_overrides import check_overrides
from verl.trainer.config_schema import ConfigError, PPOTrainerConfig, compose_config
from verl.trainer.config_validation import build_config, validate_config
from verl.trainer.plan_lora import LoraPlan, lora_plan, vllm_adapter_slot_bytes
from verl.utils import memory_model as mm

GB = 1e9
CONTEXT_BYTES = 1 * mm.GIB  # CUDA context + NCCL buffers of one process (measured 0.5-1 GiB on H100s)
ADAMW_STEP_TEMPORARIES = 1  # the foreach AdamW step allocates about one fp32 copy of the local shard
# The colocated vLLM engine besides its pool (estimates, not measured here): CUDA graphs of the decode batch sizes
# (enforce_eager false), kept while the engine sleeps; the engine's non-torch memory (its TP group's NCCL buffers).
VLLM_CUDA_GRAPH_BYTES = 1 * mm.GIB
VLLM_OTHER_BYTES = mm.GIB // 2
SAMPLER_COPIES = 2  # vLLM's sampler holds the fp32 logits of every running sequence about twice (logits, probs)
# and once more with rollout.calculate_log_probs: the log-softmax it takes the sampled tokens' log-probs from
LOGPROB_COPIES = 1
COLUMNS = ["weights", "optimizer", "gradients", "gathered units", "activations", "logits", "kv cache", "vllm",
           "cuda contexts"]


@dataclass
class Hardware:
    """The GPU the plan is for."""

    memory_bytes: float = 80 * GB
    bf16_tflops: float = 989.0
    mfu: float = 0.4
    hbm_tbps: float = 3.35
    host_gbps: float = 25.0  # pinned host <-> GPU copies (a LoRA engine's weights wake from host memory)
    decode_step_overhead_s: float = 0.03
    vllm_step_overhead_s: float = 0.005


@dataclass
class Phase:
    """Memory (bytes, by component) and time (seconds) of one phase on one GPU; ``notes`` explain it."""

    name: str
    memory: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        """Sum of the components."""
        return sum(self.memory.values())


@dataclass(frozen=True)
class MicroBatch:
    """The largest micro-batch of a pass: rows of ``seq_len`` tokens of which ``response_len`` are responses.
    A token budget (``use_dynamic_bsz``) is one packed row of that many tokens."""

    rows: int
    seq_len: int
    response_len: int

    @property
    def head_positions(self) -> int:
        """Positions that go through the LM head (those predicting a response token)."""
        return self.rows * (self.response_len + 1)


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
    actor_lora: LoraPlan | None = None
    critic_lora: LoraPlan | None = None

    @property
    def serves_adapter(self) -> bool:
        """Whether the vLLM engine keeps the base and receives the actor's LoRA adapter (not merged weights)."""
        return self.vllm and self.actor_lora is not None and not self.actor_lora.settings.merge

    def lora(self, model: str) -> LoraPlan | None:
        """The adapter of ``model`` (actor or critic), if it trains one."""
        return self.critic_lora if model == "critic" else self.actor_lora

    @property
    def vllm(self) -> bool:
        """Whether the policy generates with the colocated vLLM engine."""
        return self.cfg.actor_rollout_ref.rollout.name == "vllm"

    def micro(self, rows: int, dynamic: bool, max_token_len: int) -> MicroBatch:
        """A pass's largest micro-batch: ``rows`` full-length rows, or (``dynamic``) a packed row of
        ``max_token_len`` tokens with the full rows' share of response tokens."""
        if not dynamic:
            return MicroBatch(rows, self.seq_len, self.response_len)
        return MicroBatch(1, max_token_len, max_token_len * self.response_len // self.seq_len)


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
                 decode_steps=min(decode_steps, data.max_response_length),
                 actor_lora=lora_plan(cfg.actor_rollout_ref.model, actor, "actor_rollout_ref.model"),
                 critic_lora=lora_plan(cfg.critic.model, critic, "critic.model") if critic is not None else None)


def _states(s: Setup) -> dict[str, mm.ShardedState]:
    """Sharded state of every model on the GPU (actor, reference in the compute dtype, critic); a LoRA model's base
    in the compute dtype beside its adapter's training state, and no reference of its own for a LoRA actor."""
    b, separate = s.compute_bytes, s.cfg.actor_rollout_ref.actor.strategy == "fsdp2"
    if s.actor_lora is not None:
        states = {"actor": mm.lora_sharded_state(s.actor, s.world, b, s.actor_lora.params,
                                                 separate_embedding_units=separate)}
    else:
        states = {"actor": mm.sharded_state(s.actor, s.world, b, mm.FP32, True, separate_embedding_units=separate)}
    if s.cfg.need_reference and s.actor_lora is None:
        states["ref"] = mm.sharded_state(s.actor, s.world, b, b, False, separate_embedding_units=separate)
    if s.critic is not None:
        cb, critic_separate = _dtype_bytes(s.cfg.critic.fsdp_config.param_dtype), s.cfg.critic.strategy == "fsdp2"
        if s.critic_lora is not None:
            states["critic"] = mm.lora_sharded_state(s.critic, s.world, cb, s.critic_lora.params, value_head=True,
                                                     separate_embedding_units=critic_separate)
        else:
            states["critic"] = mm.sharded_state(s.critic, s.world, cb, mm.FP32, True, value_head=True,
                                                separate_embedding_units=critic_separate)
    return states


# Which model states a phase computes with (brought back to the GPU when offloaded between calls).
_PARAMS_USED = {"rollout": set(), "rollout hf": {"actor"}, "old": {"actor"}, "ref": {"ref"}, "values": {"critic"},
                "update critic": {"critic"}, "update actor": {"actor"}, "sync": {"actor"}}


def _state_of(s: Setup, model: str) -> str:
    """The state a pass of ``model`` computes with: a LoRA actor's reference pass is the actor's."""
    return "actor" if model == "ref" and s.actor_lora is not None else model


def _resident(s: Setup, phase: str) -> dict[str, float]:
    """Bytes of model state on the GPU during ``phase``: master shards and optimizer states, except those the
    offload keys keep in host memory outside the phases that use them; one CUDA context per process."""
    a, c = s.cfg.actor_rollout_ref, s.cfg.critic
    offloaded_params = {"actor": a.actor.fsdp_config.param_offload, "ref": a.ref.fsdp_config.param_offload,
                        "critic": c.model.fsdp_config.param_offload}
    offloaded_optim = {"actor": a.actor.fsdp_config.optimizer_offload, "critic": c.model.fsdp_config.optimizer_offload}
    weights = optimizer = 0.0
    used = {_state_of(s, m) for m in _PARAMS_USED[phase]}
    for model, state in _states(s).items():
        if not offloaded_params[model] or model in used:
            weights += state.params
        if state.optimizer and (not offloaded_optim[model] or phase == f"update {model}"):
            optimizer += state.optimizer
    contexts = CONTEXT_BYTES * (2.0 if s.critic is not None else 1.0)
    return {"weights": weights, "optimizer": optimizer, "cuda contexts": contexts}


def _vllm_resident(s: Setup, hw: Hardware) -> dict[str, float]:
    """What the vLLM engine keeps on the GPU during a training phase: nothing but its CUDA graphs and other memory
    while it sleeps (``free_cache_engine``), its whole pool otherwise; nothing without vLLM."""
    if not s.vllm:
        return {}
    rollout = s.cfg.actor_rollout_ref.rollout
    if not rollout.free_cache_engine:
        return {"vllm": rollout.gpu_memory_utilization * hw.memory_bytes}
    return {"vllm": float(VLLM_OTHER_BYTES + (0 if rollout.enforce_eager else VLLM_CUDA_GRAPH_BYTES))}


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
    phase = Phase("rollout (HF generate)", _resident(s, "rollout hf"))
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


@dataclass(frozen=True)
class VllmEngine:
    """One colocated vLLM engine's pool on one GPU of its TP group, and what the step asks of it."""

    pool: float  # gpu_memory_utilization x GPU memory
    weights: float  # the TP shard of the weights in the rollout dtype
    activations: float  # the profile run's peak (a max_num_batched_tokens forward and the sampler's logits)
    cuda_graphs: float
    other: float
    kv_bytes_per_token: int  # on this GPU (its share of the KV heads)
    dialogues: int  # dialogues per engine in a step
    concurrent: int  # of them running at once (max_num_seqs)
    max_len: int  # a dialogue's context limit (prompt + response budget)

    @property
    def kv_cache(self) -> float:
        """Bytes left in the pool for the KV cache."""
        return self.pool - self.weights - self.activations - self.cuda_graphs - self.other

    @property
    def kv_tokens(self) -> int:
        """Tokens of context the engine's KV cache holds (0 when the pool is used up)."""
        return max(0, int(self.kv_cache // self.kv_bytes_per_token))

    @property
    def peak_tokens(self) -> int:
        """Context tokens of the step's running dialogues when all of them reach their limit."""
        return self.concurrent * self.max_len


def vllm_engine(s: Setup, hw: Hardware, gpu_memory_utilization: float | None = None) -> VllmEngine:
    """The engine of ``s`` (at ``gpu_memory_utilization``, default the config's)."""
    rollout = s.cfg.actor_rollout_ref.rollout
    tp, shape, b = rollout.tensor_model_parallel_size, s.actor, s.compute_bytes
    util = rollout.gpu_memory_utilization if gpu_memory_utilization is None else gpu_memory_utilization
    kv_heads = max(1, shape.num_kv_heads // tp)  # KV heads split over the TP ranks (replicated below one each)
    batched = rollout.max_num_batched_tokens or 8192
    copies = SAMPLER_COPIES + (LOGPROB_COPIES if rollout.calculate_log_probs else 0)
    activations = (batched * shape.forward_transient_bytes_per_token(b) / tp
                   + copies * rollout.max_num_seqs * shape.vocab_size * mm.FP32)
    dialogues = -(-s.rows_per_gpu * s.world // (s.world // tp))
    weights = shape.num_params() * b / tp
    if s.serves_adapter:  # the adapter slot: every linear layer at max_lora_rank
        weights += vllm_adapter_slot_bytes(shape, s.actor_lora.settings.rank, b, tp)
    return VllmEngine(pool=util * hw.memory_bytes, weights=weights, activations=activations,
                      cuda_graphs=0.0 if rollout.enforce_eager else VLLM_CUDA_GRAPH_BYTES,
                      other=float(VLLM_OTHER_BYTES), kv_bytes_per_token=2 * shape.num_layers * kv_heads
                      * shape.head_dim * b, dialogues=dialogues, concurrent=min(dialogues, rollout.max_num_seqs),
                      max_len=rollout.max_model_len or s.seq_len)


def vllm_rollout_phase(s: Setup, hw: Hardware) -> Phase:
    """The colocated vLLM engine generating: the actor's resident state (offloaded states excepted) beside the
    engine's pool of ``gpu_memory_utilization`` x the GPU; the notes give the pool's KV cache in tokens."""
    engine = vllm_engine(s, hw)
    rollout = s.cfg.actor_rollout_ref.rollout
    phase = Phase("rollout (vLLM)", _resident(s, "rollout"))
    phase.memory["vllm"] = engine.pool
    held = engine.kv_tokens / engine.peak_tokens if engine.peak_tokens else 1.0
    phase.notes.append(
        f"vLLM engine (TP {rollout.tensor_model_parallel_size}): pool {engine.pool / GB:.1f} GB per GPU "
        f"(gpu_memory_utilization {rollout.gpu_memory_utilization:g}) = weights {engine.weights / GB:.1f} + "
        f"activations {engine.activations / GB:.1f} + CUDA graphs {engine.cuda_graphs / GB:.1f} + other "
        f"{engine.other / GB:.1f} + KV cache {max(engine.kv_cache, 0) / GB:.1f} GB = {engine.kv_tokens:,} tokens; "
        f"{engine.dialogues} dialogues per engine ({engine.concurrent} at once, max_num_seqs "
        f"{rollout.max_num_seqs}) reach up to {engine.peak_tokens:,} tokens ({engine.max_len:,} each): the KV cache "
        f"holds {min(held, 1.0):.0%} of that" + ("" if held >= 1 else ", vLLM preempts the rest (recomputed later)"))
    # decoding reads the TP shard of the weights and the KV cache in use once per step
    in_use = min(engine.kv_tokens, engine.peak_tokens // 2) * engine.kv_bytes_per_token
    step_s = max((engine.weights + in_use) / (hw.hbm_tbps * 1e12), hw.vllm_step_overhead_s)
    phase.seconds = s.decode_steps * step_s
    return phase


def weight_sync_phase(s: Setup, hw: Hardware) -> Phase:
    """After each actor update: the engine's weights awake (KV cache asleep) while bucket after bucket of the
    actor's gathered weights (about twice a bucket alive) is loaded into them."""
    engine = vllm_engine(s, hw)
    rollout = s.cfg.actor_rollout_ref.rollout
    phase = Phase("weight sync (vLLM)", _resident(s, "sync"))
    residual = _vllm_resident(s, hw)["vllm"] if not rollout.free_cache_engine else engine.other + engine.cuda_graphs
    phase.memory["vllm"] = float(residual + (engine.weights if rollout.free_cache_engine else 0.0))
    if s.serves_adapter:  # the base wakes from host memory (level-1 sleep); the adapter arrives whole
        adapter = s.actor_lora.params * s.compute_bytes
        phase.memory["gathered units"] = float(adapter)
        wake = engine.weights / (hw.host_gbps * 1e9) if rollout.free_cache_engine else 0.0
        phase.seconds = wake + adapter / (hw.hbm_tbps * 1e12)
        phase.notes.append(f"LoRA: the engine keeps the base (in host memory while it sleeps) and receives the "
                           f"adapter, {adapter / 1e6:.0f} MB, after every update")
        return phase
    phase.memory["gathered units"] = 2.0 * rollout.update_weights_bucket_megabytes * 2**20
    phase.seconds = s.actor.num_params() * s.compute_bytes / (hw.hbm_tbps * 1e12)  # at least one pass over the bytes
    return phase


def forward_phase(s: Setup, hw: Hardware, name: str, model: str, micro: int, max_token_len: int | None = None
                  ) -> Phase:
    """A no-grad forward over this GPU's rows (old log-probs, reference log-probs or values); ``micro`` rows per
    forward, or with a token budget (``log_prob_use_dynamic_bsz``) ``max_token_len`` tokens (default: the
    config's budget)."""
    states = _states(s)
    critic = model == "critic"
    shape = s.critic if critic else s.actor
    b = _dtype_bytes(s.cfg.critic.fsdp_config.param_dtype) if critic else s.compute_bytes
    dynamic, budget = _forward_dynamic(s, model)
    mb = s.micro(micro, dynamic, budget if max_token_len is None else max_token_len)
    peak = mm.forward_pass_peak(shape, mb.rows, mb.seq_len, mb.response_len, b, with_logits=not critic,
                                head_positions=mb.response_len + 1)  # the actor's head sees response positions only
    phase = Phase(name, {**_resident(s, {"actor": "old", "ref": "ref", "critic": "values"}[model]),
                         **_vllm_resident(s, hw)})
    phase.memory["gathered units"] = float(states[_state_of(s, model)].gathered)
    phase.memory["activations"] = float(peak.activations)
    phase.memory["logits"] = float(peak.logits)
    phase.seconds = _time_forward(s, hw, shape, critic)
    return phase


def _forward_dynamic(s: Setup, model: str) -> tuple[bool, int]:
    """(token budget on?, budget) of a model's forward passes."""
    a, c = s.cfg.actor_rollout_ref, s.cfg.critic
    if model == "critic":
        return c.use_dynamic_bsz, c.forward_max_token_len_per_gpu
    section = a.ref if model == "ref" else a.rollout
    return section.log_prob_use_dynamic_bsz, section.log_prob_max_token_len_per_gpu


def _update_dynamic(s: Setup, model: str) -> tuple[bool, int]:
    """(token budget on?, budget) of a model's update micro-batches."""
    section = s.cfg.critic if model == "critic" else s.cfg.actor_rollout_ref.actor
    return section.use_dynamic_bsz, section.ppo_max_token_len_per_gpu


def update_phase(s: Setup, hw: Hardware, model: str, micro: int, checkpointing: bool,
                 max_token_len: int | None = None) -> Phase:
    """A training pass over this GPU's rows: gradients, one micro-batch's activations, the optimizer step.

    ``micro`` rows per micro-batch, or with a token budget (``use_dynamic_bsz``) ``max_token_len`` tokens
    (default: the config's ``ppo_max_token_len_per_gpu``)."""
    states = _states(s)
    critic = model == "critic"
    shape = s.critic if critic else s.actor
    b = _dtype_bytes(s.cfg.critic.fsdp_config.param_dtype) if critic else s.compute_bytes
    dynamic, budget = _update_dynamic(s, model)
    mb = s.micro(micro, dynamic, budget if max_token_len is None else max_token_len)
    attn = s.cfg.actor_rollout_ref.model.attn_implementation
    peak = mm.update_pass_peak(shape, mb.rows, mb.seq_len, mb.response_len, b, checkpointing,
                               repeat_kv=attn != "flash_attention_2", head_positions=mb.response_len + 1)
    if critic:  # the value head's output is one number per position
        peak = mm.PassPeak(activations=peak.activations, logits=mb.rows * mb.seq_len * mm.FP32)
    lora = s.lora(model)
    if lora is not None:  # the adapters' rank-r intermediates: of every layer, or with checkpointing one recomputed
        per_token = shape.lora_intermediate_bytes_per_token(lora.settings.rank, lora.modules, b)
        layers = 2 / shape.num_layers if checkpointing else 1
        peak = mm.PassPeak(activations=int(peak.activations + mb.rows * mb.seq_len * per_token * layers),
                           logits=peak.logits)
    phase = Phase(f"update {model}" + (" (checkpointing)" if checkpointing else ""),
                  {**_resident(s, f"update {model}"), **_vllm_resident(s, hw)})
    phase.memory["gradients"] = float(states[model].grads)
    step = ADAMW_STEP_TEMPORARIES * states[model].grads  # about one float32 copy of the trained shard
    pass_bytes = states[model].gathered + peak.total
    phase.memory["gathered units"] = float(states[model].gathered) if pass_bytes >= step else 0.0
    phase.memory["activations"] = float(peak.activations) if pass_bytes >= step else float(step)
    phase.memory["logits"] = float(peak.logits) if pass_bytes >= step else 0.0
    flops = mm.training_flops(shape, s.rows_per_gpu, s.seq_len, checkpointing, critic, _head_positions(s, critic),
                              lora.params if lora is not None else 0)
    phase.seconds = flops / (hw.bf16_tflops * 1e12 * hw.mfu)
    return phase


def build_phases(s: Setup, hw: Hardware) -> list[Phase]:
    """Every phase of one training step, in the order the trainer runs them."""
    a = s.cfg.actor_rollout_ref
    ckpt = a.model.enable_gradient_checkpointing
    rollout = vllm_rollout_phase(s, hw) if s.vllm else rollout_phase(s, hw, a.rollout.micro_batch_size_per_gpu)
    phases = [rollout]
    if not s.cfg.algorithm.rollout_correction.bypass_mode:  # bypass: the rollout's log-probs are the old ones
        phases.append(forward_phase(s, hw, "old log-probs", "actor", a.rollout.log_prob_micro_batch_size_per_gpu))
    if s.cfg.need_reference:
        phases.append(forward_phase(s, hw, "reference log-probs", "ref", a.ref.log_prob_micro_batch_size_per_gpu))
    if s.critic is not None:
        c = s.cfg.critic
        phases.append(forward_phase(s, hw, "values (critic)", "critic", c.forward_micro_batch_size_per_gpu))
        phases.append(update_phase(s, hw, "critic", c.ppo_micro_batch_size_per_gpu,
                                   c.model.enable_gradient_checkpointing))
    phases.append(update_phase(s, hw, "actor", a.actor.ppo_micro_batch_size_per_gpu, ckpt))
    if s.vllm:
        phases.append(weight_sync_phase(s, hw))
    return phases


def _largest_fitting(build, current: int, limit: float, smallest: int = 1, step: int = 1) -> int:
    """The largest value <= ``current`` (down to ``smallest``, by ``step``) whose phase fits in ``limit`` bytes (0
    if none does)."""
    for value in range(current, smallest - 1, -step):
        if build(value).total <= limit:
            return value
    return 0


def _vllm_advice(s: Setup, hw: Hardware, phase: Phase) -> list[str]:
    """Settings to change when the engine does not fit beside the actor or its KV cache cannot hold the step."""
    a, key = s.cfg.actor_rollout_ref, "actor_rollout_ref.rollout"
    engine = vllm_engine(s, hw)
    room = hw.memory_bytes - (phase.total - engine.pool)  # what the actor's resident state leaves
    util_max = int(room / hw.memory_bytes * 100) / 100
    best = vllm_engine(s, hw, util_max)
    advice = []
    if phase.total > hw.memory_bytes:
        advice.append(f"{phase.name}: the engine's pool does not fit beside the actor's resident state "
                      f"({(phase.total - engine.pool) / GB:.1f} GB): set {key}.gpu_memory_utilization={util_max:g} "
                      f"(now {a.rollout.gpu_memory_utilization:g})")
    if engine.kv_tokens < engine.max_len:
        advice.append(f"{phase.name}: the KV cache ({engine.kv_tokens:,} tokens) cannot hold one dialogue of "
                      f"{engine.max_len:,} tokens and vLLM refuses to start: raise {key}.gpu_memory_utilization "
                      f"(at most {util_max:g} here) or {key}.tensor_model_parallel_size")
    elif engine.kv_tokens < engine.peak_tokens and not advice:
        options = []
        if util_max > a.rollout.gpu_memory_utilization:
            options.append(f"set {key}.gpu_memory_utilization={util_max:g} (the most beside the actor: "
                           f"{best.kv_tokens:,} tokens)")
        if phase.memory.get("optimizer", 0.0) > 0:
            options.append(f"set actor_rollout_ref.actor.fsdp_config.optimizer_offload=true (frees "
                           f"{phase.memory['optimizer'] / GB:.1f} GB of AdamW state while generating, for a larger "
                           f"gpu_memory_utilization)")
        fit = max(1, engine.kv_tokens // engine.max_len)
        options.append(f"or set {key}.max_num_seqs={fit} so that the running dialogues fit at full length (the "
                       f"others wait instead of being preempted)")
        advice.append(f"{phase.name}: the KV cache holds {engine.kv_tokens:,} of up to {engine.peak_tokens:,} "
                      f"dialogue tokens: " + "; ".join(options))
    return advice


def advise(s: Setup, hw: Hardware, phases: list[Phase]) -> list[str]:
    """Settings to change for the phases that do not fit in ``hw.memory_bytes`` (and a vLLM KV cache too small
    for the step's dialogues)."""
    a, limit, advice = s.cfg.actor_rollout_ref, hw.memory_bytes, []
    resident = sum(_resident(s, "update actor").values())
    if resident > limit:
        advice.append(f"the sharded weights and optimizer states alone need {resident / GB:.1f} GB per GPU: raise "
                      f"trainer.n_gpus_per_node / trainer.nnodes (now {s.world} GPUs), or offload parameters and "
                      "optimizer states to the CPU (fsdp_config.param_offload / optimizer_offload)")
        return advice
    knobs = {
        "rollout": ("actor_rollout_ref.rollout.micro_batch_size_per_gpu", a.rollout.micro_batch_size_per_gpu,
                    lambda m: rollout_phase(s, hw, m)),
        "old": ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                a.rollout.log_prob_micro_batch_size_per_gpu, lambda m: forward_phase(s, hw, "", "actor", m)),
        "reference": ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
                      a.ref.log_prob_micro_batch_size_per_gpu, lambda m: forward_phase(s, hw, "", "ref", m)),
        "values": ("critic.forward_micro_batch_size_per_gpu", s.cfg.critic.forward_micro_batch_size_per_gpu,
                   lambda m: forward_phase(s, hw, "", "critic", m)),
    }
    budget_keys = {"old": "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
                   "reference": "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
                   "values": "critic.forward_max_token_len_per_gpu"}
    for phase in phases:
        head = phase.name.split()[0]
        if phase.name == "rollout (vLLM)":
            advice += _vllm_advice(s, hw, phase)
            continue
        if phase.total <= limit:
            continue
        if head == "weight":
            advice.append(f"{phase.name}: lower actor_rollout_ref.rollout.update_weights_bucket_megabytes (now "
                          f"{a.rollout.update_weights_bucket_megabytes:g}) or offload the optimizer "
                          "(actor_rollout_ref.actor.fsdp_config.optimizer_offload=true)")
            continue
        if head == "update":
            advice.append(_update_advice(s, hw, phase, limit))
            continue
        key, now, build = knobs[head]
        model = {"old": "actor", "reference": "ref", "values": "critic"}.get(head)
        dynamic, budget = _forward_dynamic(s, model) if model else (False, 0)
        if dynamic:
            key, now = budget_keys[head], budget
            fit = _largest_fitting(lambda t: forward_phase(s, hw, "", model, 1, t), budget, limit, s.seq_len, 1024)
        else:
            fit = _largest_fitting(build, now, limit)
        critic_hint = ("; or keep the critic off the GPU outside its phases (critic.model.fsdp_config.param_offload "
                       "/ optimizer_offload)") if s.critic is not None and head != "values" else ""
        if fit:
            advice.append(f"{phase.name}: set {key}={fit} (now {now}){critic_hint}")
        else:
            advice.append(f"{phase.name}: does not fit even with one row per micro-batch: add GPUs or shorten the "
                          "sequences")
    return advice


def _update_advice(s: Setup, hw: Hardware, phase: Phase, limit: float) -> str:
    """What to change for an update phase that does not fit."""
    a = s.cfg.actor_rollout_ref
    model = phase.name.split()[1]
    ckpt = (s.cfg.critic.model if model == "critic" else a.model).enable_gradient_checkpointing
    prefix = "critic" if model == "critic" else "actor_rollout_ref"
    section_key = "critic" if model == "critic" else "actor_rollout_ref.actor"
    micro_now = (s.cfg.critic if model == "critic" else a.actor).ppo_micro_batch_size_per_gpu
    dynamic, budget = _update_dynamic(s, model)
    if not ckpt and update_phase(s, hw, model, micro_now, True).total <= limit:
        return f"{phase.name}: set {prefix}.model.enable_gradient_checkpointing=true"
    if dynamic:
        fit = _largest_fitting(lambda t: update_phase(s, hw, model, 1, True, t), budget, limit, s.seq_len, 1024)
        setting = f"{section_key}.ppo_max_token_len_per_gpu={fit}"
    else:
        fit = _largest_fitting(lambda m: update_phase(s, hw, model, m, True), micro_now, limit)
        setting = f"{section_key}.ppo_micro_batch_size_per_gpu={fit}"
    if fit:
        return f"{phase.name}: set {prefix}.model.enable_gradient_checkpointing=true and {setting}"
    return (f"{phase.name}: one row of {s.seq_len} tokens does not fit even with checkpointing: shorten "
            "data.max_prompt_length / max_response_length, add GPUs, or offload the optimizer "
            "(fsdp_config.optimizer_offload)")


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


def format_plan(s: Setup, hw: Hardware, phases: list[Phase], advice: list[str]) -> str:
    """The printed plan: the setup, one table row per phase (GB), the verdict, the notes and the advice."""
    columns = [c for c in COLUMNS if c != "vllm" or s.vllm]
    lines = [f"model: {count_text(s.actor.num_params())} parameters ({s.actor.num_layers} layers, hidden "
             f"{s.actor.hidden_size}, vocab {s.actor.vocab_size}); {s.world} GPUs of {hw.memory_bytes / GB:.0f} GB; "
             f"{s.rows_per_gpu} rows of {s.seq_len} tokens per GPU and step; compute dtype "
             f"{'bf16' if s.compute_bytes == 2 else 'fp32'}",
             *[_lora_line(name, lora, shape) for name, lora, shape in
               (("actor", s.actor_lora, s.actor), ("critic", s.critic_lora, s.critic)) if lora is not None],
             f"{'phase (per GPU, GB)':<34}" + "".join(f"{c[:11]:>12}" for c in columns) + f"{'total':>9}{'time':>10}"]
    for p in phases:
        cells = "".join(f"{p.memory.get(c, 0.0) / GB:>12.1f}" for c in columns)
        lines.append(f"{p.name:<34}{cells}{p.total / GB:>9.1f}{p.seconds / 60:>8.1f} m")
    worst = max(phases, key=lambda p: p.total)
    total_min = sum(p.seconds for p in phases) / 60
    verdict = "fits" if worst.total <= hw.memory_bytes else "DOES NOT FIT"
    decode = (f"vLLM decoding at max(weights/TP + KV / {hw.hbm_tbps} TB/s, {hw.vllm_step_overhead_s * 1e3:.0f} ms)"
              if s.vllm else f"decoding at max(weights+KV / {hw.hbm_tbps} TB/s, "
              f"{hw.decode_step_overhead_s * 1e3:.0f} ms)")
    lines.append(f"peak {worst.total / GB:.1f} GB in '{worst.name}': {verdict} in {hw.memory_bytes / GB:.0f} GB; "
                 f"about {total_min:.1f} min per step (training at {hw.mfu:.0%} of {hw.bf16_tflops:.0f} TFLOP/s, "
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
