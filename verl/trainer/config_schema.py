"""Typed mirror of ``verl/trainer/config/ppo_trainer.yaml`` and Hydra composition of it.

Every YAML key has a dataclass field here (a test checks both directions); ``rollout_loop.config`` and
``reward.kwargs`` are free-form: their plug-ins check them. Turning a composed config into a checked
:class:`PPOTrainerConfig` (unknown keys, types, cross-field rules) is :mod:`verl.trainer.config_validation`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union, get_args

CONFIG_DIR = Path(__file__).resolve().parent / "config"
CONFIG_NAME = "ppo_trainer"

GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline", "grpo_vectorized", "rloo_vectorized",
                    "turn_mixed")
CRITIC_ESTIMATORS = ("gae", "turn_gae")
KL_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
LOGGERS = ("console", "jsonl", "wandb", "tensorboard", "mlflow")

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
Strategy = Literal["fsdp2", "fsdp"]
ParamDtype = Literal["auto", "fp32", "bf16"]
WarmupStyle = Literal["constant", "cosine"]
DiagnosisApplyTo = Literal["all", "negative", "positive"]
DIAGNOSIS_APPLY_TO: tuple[str, ...] = get_args(DiagnosisApplyTo)
DIAGNOSIS_WEIGHT_MAX = 2.0  # the bound of a label weight in algorithm.diagnosis_reweight.weights: [0, 2]


class ConfigError(ValueError):
    """A configuration value is missing, unknown, of the wrong type or inconsistent; the message names the key."""


@dataclass
class DataConfig:
    """``data.*``: prompt files, lengths and batch sizes."""

    train_files: Optional[Union[str, list[str]]] = None
    val_files: Optional[Union[str, list[str]]] = None
    prompt_key: str = "prompt"
    max_prompt_length: int = 128
    max_response_length: int = 16
    truncation: Literal["error", "left", "right"] = "error"
    filter_overlong_prompts: bool = False
    train_batch_size: int = 8
    val_batch_size: Optional[int] = None
    shuffle: bool = True
    seed: int = 1


@dataclass
class ModelLoraConfig:
    """``actor_rollout_ref.model.lora.*``: how a LoRA actor's weights reach the vLLM engine (veRL's key)."""

    merge: bool = False


@dataclass
class ModelConfig:
    """``actor_rollout_ref.model.*``: the Hugging Face model shared by actor, rollout and reference, and the actor's
    LoRA adapter (veRL's keys; ``lora_rank`` 0 = full fine-tuning)."""

    path: Optional[str] = None
    tokenizer_path: Optional[str] = None
    use_shm: bool = False
    enable_gradient_checkpointing: bool = False
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"
    use_remove_padding: bool = False
    lora_rank: int = 0
    lora_alpha: float = 16.0
    target_modules: Union[str, list[str]] = "all-linear"
    exclude_modules: Optional[Union[str, list[str]]] = None
    lora: ModelLoraConfig = field(default_factory=ModelLoraConfig)


@dataclass
class OptimConfig:
    """``*.optim.*``: AdamW and the warm-up / decay schedule."""

    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    lr_warmup_steps: int = -1
    lr_warmup_steps_ratio: float = 0.0
    warmup_style: WarmupStyle = "constant"
    min_lr_ratio: float = 0.0
    total_training_steps: int = -1


@dataclass
class FSDPConfig:
    """``*.fsdp_config.*``: FSDP wrapping options."""

    param_dtype: ParamDtype = "auto"
    reshard_after_forward: bool = True


@dataclass
class ActorFSDPConfig(FSDPConfig):
    """``actor_rollout_ref.actor.fsdp_config.*``: FSDP wrapping plus CPU offload (GPU only)."""

    param_offload: bool = False
    optimizer_offload: bool = False


@dataclass
class RefFSDPConfig:
    """``actor_rollout_ref.ref.fsdp_config.*``: CPU offload of the reference parameters (GPU only)."""

    param_offload: bool = False


@dataclass
class CriticFSDPOffloadConfig:
    """``critic.model.fsdp_config.*``: CPU offload of the value model (GPU only)."""

    param_offload: bool = False
    optimizer_offload: bool = False


@dataclass
class ActorConfig:
    """``actor_rollout_ref.actor.*``: the policy update."""

    strategy: Strategy = "fsdp2"
    ppo_mini_batch_size: int = 4
    ppo_micro_batch_size_per_gpu: int = 4
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    ppo_epochs: int = 1
    shuffle: bool = False
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = 0.2
    clip_ratio_high: Optional[float] = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: LossAggMode = "token-mean"
    loss_scale_factor: Optional[float] = None
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    grad_clip: float = 1.0
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp_config: ActorFSDPConfig = field(default_factory=ActorFSDPConfig)
    seed: int = 42


@dataclass
class RefConfig:
    """``actor_rollout_ref.ref.*``: the frozen reference policy."""

    log_prob_micro_batch_size_per_gpu: int = 8
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int = 16384
    fsdp_config: RefFSDPConfig = field(default_factory=RefFSDPConfig)


@dataclass
class ValKwargsConfig:
    """``actor_rollout_ref.rollout.val_kwargs.*``: validation decoding."""

    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1


@dataclass
class RolloutConfig:
    """``actor_rollout_ref.rollout.*``: the sampling engine."""

    name: Literal["hf", "vllm"] = "hf"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = True
    n: int = 1
    prompt_length: int = 128
    response_length: int = 16
    log_prob_micro_batch_size_per_gpu: int = 8
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int = 16384
    micro_batch_size_per_gpu: int = 16
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    # the vLLM engine (name=vllm)
    tensor_model_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = 8192
    max_model_len: Optional[int] = None
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    seed: int = 0
    free_cache_engine: bool = True
    update_weights_bucket_megabytes: float = 512
    calculate_log_probs: bool = False
    n_gpus_per_node: int = 0  # 0: on the actor's workers; N > 0: on N devices of its own (split placement)


@dataclass
class ActorRolloutRefConfig:
    """``actor_rollout_ref.*``: what ActorRolloutRefWorker receives."""

    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    nccl_timeout: int = 600
    checkpoint_timeout: int = 3600
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


@dataclass
class CriticModelConfig:
    """``critic.model.*``: the value-model backbone and its LoRA adapter (veRL's keys)."""

    path: Optional[str] = None
    use_shm: bool = False
    enable_gradient_checkpointing: bool = False
    use_remove_padding: bool = False
    lora_rank: int = 0
    lora_alpha: float = 16.0
    target_modules: Union[str, list[str]] = "all-linear"
    fsdp_config: CriticFSDPOffloadConfig = field(default_factory=CriticFSDPOffloadConfig)


@dataclass
class CriticConfig:
    """``critic.*``: what CriticWorker receives (only built for the estimators that read values: gae, turn_gae)."""

    strategy: Strategy = "fsdp2"
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    nccl_timeout: int = 600
    checkpoint_timeout: int = 3600
    rollout_n: int = 1
    ppo_mini_batch_size: int = 4
    ppo_micro_batch_size_per_gpu: int = 4
    forward_micro_batch_size_per_gpu: int = 8
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 32768
    forward_max_token_len_per_gpu: int = 32768
    ppo_epochs: int = 1
    shuffle: bool = False
    cliprange_value: float = 0.5
    loss_agg_mode: LossAggMode = "token-mean"
    loss_scale_factor: Optional[float] = None
    grad_clip: float = 1.0
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class KLControlConfig:
    """``algorithm.kl_ctrl.*``: the in-reward KL coefficient controller."""

    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class FilterGroupsConfig:
    """``algorithm.filter_groups.*``: dynamic sampling of prompt groups with a signal (DAPO)."""

    enable: bool = False
    metric: str = "seq_reward"
    max_num_gen_batches: int = 0


@dataclass
class TurnMixedConfig:
    """``algorithm.turn_mixed.*``: the ``turn_mixed`` estimator (outcome + turn-level advantage)."""

    turn_weight: float = 1.0


@dataclass
class DiagnosisReweightConfig:
    """``algorithm.diagnosis_reweight.*``: scale the advantages of agent turns by their failure labels (SEAL)."""

    enable: bool = False
    weights: dict[str, float] = field(default_factory=dict)
    apply_to: DiagnosisApplyTo = "negative"


@dataclass
class RolloutCorrectionConfig:
    """``algorithm.rollout_correction.*``: importance weights and rejection for the gap between the rollout engine's
    and the trainer's policy (veRL's keys; :mod:`verl.trainer.ppo.rollout_corr_helper`)."""

    rollout_is: Optional[Literal["token", "turn", "sequence"]] = None
    rollout_is_threshold: Union[float, str] = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: Optional[str] = None
    rollout_rs_threshold: Optional[Union[float, str]] = None
    bypass_mode: bool = False
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"

    @property
    def enabled(self) -> bool:
        """Whether anything corrects (weights, rejection or bypass), beyond the metrics."""
        return self.rollout_is is not None or self.rollout_rs is not None or self.bypass_mode


@dataclass
class AlgorithmConfig:
    """``algorithm.*``: advantage estimation, KL shaping, dynamic sampling, turn-level credit and rollout
    correction."""

    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    turn_mixed: TurnMixedConfig = field(default_factory=TurnMixedConfig)
    diagnosis_reweight: DiagnosisReweightConfig = field(default_factory=DiagnosisReweightConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass
class RewardConfig:
    """``reward.*``: the reward plug-in and its keyword arguments (free-form)."""

    path: str = "verl.tasks.repeat_letter.compute_reward"
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class RolloutLoopConfig:
    """``rollout_loop.*``: the optional rollout-loop plug-in class and its free-form config."""

    path: Optional[str] = None
    config: dict[str, Any] = field(default_factory=dict)


@dataclass
class AsyncTrainingConfig:
    """``async_training.*``: overlap of generation and training (veRL's key names; docs/off_policy.md).

    ``staleness_threshold``: how many policy versions a trained token may lag the trainer's; 0 = the synchronous
    barrier (default), 1 = one-step-off (step N+1's dialogues are generated while step N trains), k >= 2 = up to k
    steps' rollouts ahead of the trainer. ``partial_rollout``: dialogues in flight continue across several updates
    (required by, and only allowed with, k >= 2). ``rollouts_in_flight``: how many of the k queued rollouts run at
    once (1, the default: one after another)."""

    staleness_threshold: float = 0
    partial_rollout: bool = False
    rollouts_in_flight: float = 1


@dataclass
class TrainerConfig:
    """``trainer.*``: loop length, resources, logging, validation and checkpoints."""

    project_name: str = "sead"
    experiment_name: str = "default"
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    log_dir: str = "outputs/logs/sead/default"
    nnodes: int = 1
    n_gpus_per_node: int = 1
    device: Literal["auto", "cpu", "cuda"] = "auto"
    total_epochs: int = 1
    total_training_steps: Optional[int] = None
    save_freq: int = -1
    test_freq: int = -1
    val_before_train: bool = True
    val_only: bool = False
    log_val_generations: int = 0
    critic_warmup: int = 0
    balance_batch: bool = True
    default_local_dir: str = "checkpoints/sead/default"
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    resume_from_path: Optional[str] = None
    resume_from_other_model: bool = False
    trust_checkpoint: bool = False
    max_ckpt_to_keep: Optional[int] = None
    save_hf_model: Literal["every", "last", "never"] = "every"
    seed: int = 1
    ray_num_cpus: Optional[int] = None


@dataclass
class PPOTrainerConfig:
    """The whole trainer configuration (the job config of ``ppo_trainer.yaml``)."""

    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout_loop: RolloutLoopConfig = field(default_factory=RolloutLoopConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    @property
    def world_size(self) -> int:
        """DP world size: nnodes * n_gpus_per_node."""
        return self.trainer.nnodes * self.trainer.n_gpus_per_node

    @property
    def need_reference(self) -> bool:
        """Whether reference log-probs are needed (KL loss or KL in reward)."""
        return self.actor_rollout_ref.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def need_critic(self) -> bool:
        """Whether a value model is trained (the estimators that read values: gae, turn_gae)."""
        return self.algorithm.adv_estimator in CRITIC_ESTIMATORS


def compose_config(overrides: Optional[list[str]] = None, config_name: str = CONFIG_NAME) -> Any:
    """Compose ``<config_name>.yaml`` (default ``ppo_trainer``; ``sead_trainer`` for dialogue training) from the
    config directory with Hydra command-line style overrides and return the job DictConfig."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name=config_name, overrides=list(overrides or []))
