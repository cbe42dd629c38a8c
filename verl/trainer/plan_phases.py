"""The phases of one training step on one GPU (rollout, log-prob and value forwards, updates, the vLLM weight
sync; with the rollout on GPUs of its own, its phase on one of those and the weight export on the trainer's): memory
by component and a rough time each, from the memory model (:mod:`verl.utils.memory_model`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from verl.trainer.plan_lora import vllm_adapter_slot_bytes
from verl.trainer.plan_passes import sync_transient_bytes, update_pass_moments
from verl.trainer.plan_setup import (CONTEXT_BYTES, GB, Hardware, Phase, Setup, dtype_bytes, forward_token_budget,
                                     resident_bytes,
                                     sharded_states, state_of, update_token_budget)
from verl.utils import memory_model as mm

ADAMW_STEP_TEMPORARIES = 1  # the foreach AdamW step allocates about one fp32 copy of the local shard
# The colocated vLLM engine besides its pool (estimates, not measured here): CUDA graphs of the decode batch sizes
# (enforce_eager false), kept while the engine sleeps; the engine's non-torch memory (its TP group's NCCL buffers).
VLLM_CUDA_GRAPH_BYTES = 1 * mm.GIB
VLLM_OTHER_BYTES = mm.GIB // 2
SAMPLER_COPIES = 2  # vLLM's sampler holds the fp32 logits of every running sequence about twice (logits, probs)
# and once more with rollout.calculate_log_probs: the log-softmax it takes the sampled tokens' log-probs from
LOGPROB_COPIES = 1


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
    states = sharded_states(s)
    b, shape = s.compute_bytes, s.actor
    phase = Phase("rollout (HF generate)", resident_bytes(s, "rollout hf"))
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


def vllm_rollout_phase(s: Setup, hw: Hardware, own_gpus: bool = False) -> Phase:
    """The vLLM engine generating: colocated, the actor's resident state (offloaded states excepted) beside the
    engine's pool of ``gpu_memory_utilization`` x the GPU; on GPUs of its own (``own_gpus``, ``s`` the rollout's
    side: :func:`rollout_side`), the pool and a CUDA context. The notes give the pool's KV
    cache in tokens."""
    engine = vllm_engine(s, hw)
    rollout = s.cfg.actor_rollout_ref.rollout
    resident = {"cuda contexts": float(CONTEXT_BYTES)} if own_gpus else resident_bytes(s, "rollout")
    phase = Phase("rollout (vLLM, own GPUs)" if own_gpus else "rollout (vLLM)", resident, on_rollout_gpus=own_gpus)
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
    actor's gathered weights is loaded into them (:func:`verl.trainer.plan_passes.sync_transient_bytes`)."""
    engine = vllm_engine(s, hw)
    rollout = s.cfg.actor_rollout_ref.rollout
    phase = Phase("weight sync (vLLM)", resident_bytes(s, "sync"))
    residual = _vllm_resident(s, hw)["vllm"] if not rollout.free_cache_engine else engine.other + engine.cuda_graphs
    phase.memory["vllm"] = float(residual + (engine.weights if rollout.free_cache_engine else 0.0))
    if s.serves_adapter:  # the base wakes from host memory (level-1 sleep); the adapter arrives whole
        adapter = s.actor_lora.params * s.compute_bytes
        phase.memory["gathered units"] = float(sync_transient_bytes(s))
        wake = engine.weights / (hw.host_gbps * 1e9) if rollout.free_cache_engine else 0.0
        phase.seconds = wake + adapter / (hw.hbm_tbps * 1e12)
        phase.notes.append(f"LoRA: the engine keeps the base (in host memory while it sleeps) and receives the "
                           f"adapter, {adapter / 1e6:.0f} MB, after every update")
        return phase
    phase.memory["gathered units"] = float(sync_transient_bytes(s))
    phase.seconds = s.actor.num_params() * s.compute_bytes / (hw.hbm_tbps * 1e12)  # at least one pass over the bytes
    return phase


def forward_phase(s: Setup, hw: Hardware, name: str, model: str, micro: int, max_token_len: int | None = None
                  ) -> Phase:
    """A no-grad forward over this GPU's rows (old log-probs, reference log-probs or values); ``micro`` rows per
    forward, or with a token budget (``log_prob_use_dynamic_bsz``) ``max_token_len`` tokens (default: the
    config's budget)."""
    states = sharded_states(s)
    critic = model == "critic"
    shape = s.critic if critic else s.actor
    b = dtype_bytes(s.cfg.critic.fsdp_config.param_dtype) if critic else s.compute_bytes
    dynamic, budget = forward_token_budget(s, model)
    mb = s.micro(micro, dynamic, budget if max_token_len is None else max_token_len, _packed(s, model))
    fsdp2 = (s.cfg.critic if critic else s.cfg.actor_rollout_ref.actor).strategy == "fsdp2"
    moments = mm.forward_pass_moments(shape, mb.rows, mb.seq_len, mb.response_len, b, with_logits=not critic,
                                      head_positions=mb.response_len + 1,  # per row: the head on responses
                                      gathered=states[state_of(s, model)].gathered, released_before_logits=fsdp2)
    phase = Phase(name, {**resident_bytes(s, {"actor": "old", "ref": "ref", "critic": "values"}[model]),
                         **_vllm_resident(s, hw), **_transient(mm.largest(moments))}, moments=moments)
    phase.seconds = _time_forward(s, hw, shape, critic)
    return phase


def _transient(peak: mm.PassPeak) -> dict[str, float]:
    """A pass's items at its peak."""
    return {"gathered units": float(peak.gathered), "activations": float(peak.activations),
            "logits": float(peak.logits)}


def _packed(s: Setup, model: str) -> bool:
    """Whether a model's forwards run on packed rows (``use_remove_padding``)."""
    return (s.cfg.critic if model == "critic" else s.cfg.actor_rollout_ref).model.use_remove_padding


def update_phase(s: Setup, hw: Hardware, model: str, micro: int, checkpointing: bool,
                 max_token_len: int | None = None) -> Phase:
    """A training pass over this GPU's rows: gradients, one micro-batch's activations, the optimizer step.

    ``micro`` rows per micro-batch, or with a token budget (``use_dynamic_bsz``) ``max_token_len`` tokens
    (default: the config's ``ppo_max_token_len_per_gpu``)."""
    states = sharded_states(s)
    critic = model == "critic"
    shape = s.critic if critic else s.actor
    b = dtype_bytes(s.cfg.critic.fsdp_config.param_dtype) if critic else s.compute_bytes
    dynamic, budget = update_token_budget(s, model)
    mb = s.micro(micro, dynamic, budget if max_token_len is None else max_token_len, _packed(s, model))
    step = ADAMW_STEP_TEMPORARIES * states[model].grads  # about one float32 copy of the trained shard
    moments = [*update_pass_moments(s, model, mb, b, checkpointing, states[model].gathered),
               mm.PassPeak(step, 0, 0, "the optimizer step")]
    phase = Phase(f"update {model}" + (" (checkpointing)" if checkpointing else ""),
                  {**resident_bytes(s, f"update {model}"), **_vllm_resident(s, hw),
                   "gradients": float(states[model].grads),
                   **_transient(mm.largest(moments))}, moments=moments)
    lora = s.lora(model)
    flops = mm.training_flops(shape, s.rows_per_gpu, s.seq_len, checkpointing, critic, _head_positions(s, critic),
                              lora.params if lora is not None else 0)
    phase.seconds = flops / (hw.bf16_tflops * 1e12 * hw.mfu)
    return phase


def build_phases(s: Setup, hw: Hardware) -> list[Phase]:
    """Every phase of one training step, in the order the trainer runs them."""
    a = s.cfg.actor_rollout_ref
    ckpt = a.model.enable_gradient_checkpointing
    if s.split:
        rollout = split_rollout_phase(s, hw)
    else:
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
    if s.split:
        phases += [export_phase(s, hw), install_phase(s, hw)]
    return phases


def rollout_side(s: Setup) -> Setup:
    """``s`` as the rollout's own GPUs see it (split placement): the step's rows over ``rollout_gpus`` devices."""
    rows = s.rows_per_gpu * s.world
    return dataclasses.replace(s, world=s.rollout_gpus, rows_per_gpu=-(-rows // s.rollout_gpus))


def split_rollout_phase(s: Setup, hw: Hardware) -> Phase:
    """The rollout on one of its own GPUs: the vLLM engine alone (its pool, no actor state), or HF generate on the
    rollout group's own FSDP shards of the model (fp32, no optimizer) gathered whole for each call."""
    side = rollout_side(s)
    a = s.cfg.actor_rollout_ref
    if a.rollout.name == "vllm":
        return vllm_rollout_phase(side, hw, own_gpus=True)
    phase = rollout_phase(side, hw, a.rollout.micro_batch_size_per_gpu)
    phase.name, phase.on_rollout_gpus = "rollout (HF generate, own GPUs)", True
    phase.memory.update(weights=float(s.actor.num_params() * mm.FP32 / side.world), optimizer=0.0,
                        **{"cuda contexts": float(CONTEXT_BYTES)})
    return phase


def export_phase(s: Setup, hw: Hardware) -> Phase:
    """After each update, on the trainer's GPUs: the actor's buckets (a LoRA actor's adapter alone) gathered in the
    compute dtype and copied to host memory on rank 0."""
    phase = Phase("weight export (to the rollout's GPUs)", resident_bytes(s, "sync"))
    phase.memory["gathered units"] = float(sync_transient_bytes(s))
    sent = _sync_bytes(s)
    phase.seconds = sent / (hw.host_gbps * 1e9)
    what = "the adapter" if s.syncs_adapter else "the full weights"
    phase.notes.append(f"split placement: rank 0 holds {what} in host memory ({sent / GB:.2f} GB) while the "
                       f"rollout's {s.rollout_gpus} GPUs install them" + (" (the frozen base once, at the start)"
                                                                          if s.syncs_adapter else ""))
    return phase


def install_phase(s: Setup, hw: Hardware) -> Phase:
    """The rollout's GPUs copying the exported weights in from host memory, between two generation calls (the
    trainer goes on meanwhile)."""
    phase = Phase("weight install (rollout's GPUs)", dict(split_rollout_phase(s, hw).memory), on_rollout_gpus=True)
    phase.seconds = _sync_bytes(s) / (hw.host_gbps * 1e9)
    return phase


def _sync_bytes(s: Setup) -> float:
    """What one sync after an update moves: the adapter, or every weight, in the compute dtype."""
    return (s.actor_lora.params if s.syncs_adapter else s.actor.num_params()) * s.compute_bytes
