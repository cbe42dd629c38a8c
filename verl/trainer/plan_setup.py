"""What a training step's plan (``python -m verl.trainer.plan``) is computed from: the GPU, the config's per-GPU
quantities and micro-batches, and the models' sharded states resident on the GPU in each phase."""
from __future__ import annotations

from dataclasses import dataclass, field

from verl.trainer.config_schema import PPOTrainerConfig
from verl.trainer.plan_lora import LoraPlan, lora_plan
from verl.utils import memory_model as mm

GB = 1e9
CONTEXT_BYTES = 1 * mm.GIB  # CUDA context + NCCL buffers of one process (measured 0.5-1 GiB on H100s)


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
    moments: list[mm.PassPeak] = field(default_factory=list)  # a pass's candidate peaks; ``memory`` has the largest
    on_rollout_gpus: bool = False  # a phase of the rollout's own GPUs (split placement), not the trainer's

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
    rollout_gpus: int = 0  # the rollout's own GPUs (split placement); 0: it runs on the trainer's

    @property
    def split(self) -> bool:
        """Whether the rollout runs on GPUs of its own (``actor_rollout_ref.rollout.n_gpus_per_node`` > 0)."""
        return self.rollout_gpus > 0

    @property
    def syncs_adapter(self) -> bool:
        """Whether the rollout keeps the actor's frozen base and receives its LoRA adapter alone after each update
        (a vLLM engine, or a rollout on GPUs of its own; not with merged weights)."""
        lora, rollout = self.actor_lora, self.cfg.actor_rollout_ref.rollout
        return lora is not None and not lora.settings.merge and (rollout.name == "vllm" or self.split)

    @property
    def serves_adapter(self) -> bool:
        """Whether a vLLM engine (colocated or on GPUs of its own) serves the actor's LoRA adapter on its base."""
        return self.syncs_adapter and self.cfg.actor_rollout_ref.rollout.name == "vllm"

    def lora(self, model: str) -> LoraPlan | None:
        """The adapter of ``model`` (actor or critic), if it trains one."""
        return self.critic_lora if model == "critic" else self.actor_lora

    @property
    def vllm(self) -> bool:
        """Whether the policy generates with a vLLM engine colocated with the actor (the hybrid engine)."""
        return self.cfg.actor_rollout_ref.rollout.name == "vllm" and not self.split

    def micro(self, rows: int, dynamic: bool, max_token_len: int, packed: bool = True) -> MicroBatch:
        """A pass's largest micro-batch: ``rows`` full-length rows, or (``dynamic``) a packed row of
        ``max_token_len`` tokens with the full rows' share of response tokens (padded: the full rows it holds)."""
        if dynamic and packed:
            return MicroBatch(1, max_token_len, max_token_len * self.response_len // self.seq_len)
        return MicroBatch(max(1, max_token_len // self.seq_len) if dynamic else rows, self.seq_len, self.response_len)


def dtype_bytes(param_dtype: str) -> int:
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
                 compute_bytes=dtype_bytes(cfg.actor_rollout_ref.actor.fsdp_config.param_dtype),
                 rows_per_gpu=-(-rows // cfg.world_size), seq_len=data.max_prompt_length + data.max_response_length,
                 response_len=data.max_response_length, prompt_len=data.max_prompt_length,
                 decode_steps=min(decode_steps, data.max_response_length),
                 actor_lora=lora_plan(cfg.actor_rollout_ref.model, actor, "actor_rollout_ref.model"),
                 critic_lora=lora_plan(cfg.critic.model, critic, "critic.model") if critic is not None else None,
                 rollout_gpus=rollout.n_gpus_per_node)


def sharded_states(s: Setup) -> dict[str, mm.ShardedState]:
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
        cb, critic_separate = dtype_bytes(s.cfg.critic.fsdp_config.param_dtype), s.cfg.critic.strategy == "fsdp2"
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


def state_of(s: Setup, model: str) -> str:
    """The state a pass of ``model`` computes with: a LoRA actor's reference pass is the actor's."""
    return "actor" if model == "ref" and s.actor_lora is not None else model


def resident_bytes(s: Setup, phase: str) -> dict[str, float]:
    """Bytes of model state on the GPU during ``phase``: master shards and optimizer states, except those the
    offload keys keep in host memory outside the phases that use them; one CUDA context per process."""
    a, c = s.cfg.actor_rollout_ref, s.cfg.critic
    offloaded_params = {"actor": a.actor.fsdp_config.param_offload, "ref": a.ref.fsdp_config.param_offload,
                        "critic": c.model.fsdp_config.param_offload}
    offloaded_optim = {"actor": a.actor.fsdp_config.optimizer_offload, "critic": c.model.fsdp_config.optimizer_offload}
    weights = optimizer = 0.0
    used = {state_of(s, m) for m in _PARAMS_USED[phase]}
    for model, state in sharded_states(s).items():
        if not offloaded_params[model] or model in used:
            weights += state.params
        if state.optimizer and (not offloaded_optim[model] or phase == f"update {model}"):
            optimizer += state.optimizer
    contexts = CONTEXT_BYTES * (2.0 if s.critic is not None else 1.0)
    return {"weights": weights, "optimizer": optimizer, "cuda contexts": contexts}


def forward_token_budget(s: Setup, model: str) -> tuple[bool, int]:
    """(token budget on?, budget) of a model's forward passes."""
    a, c = s.cfg.actor_rollout_ref, s.cfg.critic
    if model == "critic":
        return c.use_dynamic_bsz, c.forward_max_token_len_per_gpu
    section = a.ref if model == "ref" else a.rollout
    return section.log_prob_use_dynamic_bsz, section.log_prob_max_token_len_per_gpu


def update_token_budget(s: Setup, model: str) -> tuple[bool, int]:
    """(token budget on?, budget) of a model's update micro-batches."""
    section = s.cfg.critic if model == "critic" else s.cfg.actor_rollout_ref.actor
    return section.use_dynamic_bsz, section.ppo_max_token_len_per_gpu
