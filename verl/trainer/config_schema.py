"""Typed mirror of ``verl/trainer/config/ppo_trainer.yaml`` and its validation.

Every YAML key has a dataclass field here (a test checks both directions). ``build_config`` turns a (Hydra /
OmegaConf / plain) mapping into a :class:`PPOTrainerConfig`, failing on unknown keys with their full dotted name
and on values of the wrong type; ``validate_config`` adds the cross-field rules (required paths, batch-size
divisibility, enumerations). ``rollout_loop.config`` and ``reward.kwargs`` are free-form: their plug-ins check them.
"""
from __future__ import annotations

import dataclasses
import difflib
import logging
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Union

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parent / "config"
CONFIG_NAME = "ppo_trainer"

GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")
KL_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
LOGGERS = ("console", "jsonl", "wandb", "tensorboard")

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
Strategy = Literal["fsdp2", "fsdp"]
ParamDtype = Literal["auto", "fp32", "bf16"]
WarmupStyle = Literal["constant", "cosine"]


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
class ModelConfig:
    """``actor_rollout_ref.model.*``: the Hugging Face model shared by actor, rollout and reference."""

    path: Optional[str] = None
    tokenizer_path: Optional[str] = None
    enable_gradient_checkpointing: bool = False
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"


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
class ActorConfig:
    """``actor_rollout_ref.actor.*``: the policy update."""

    strategy: Strategy = "fsdp2"
    ppo_mini_batch_size: int = 4
    ppo_micro_batch_size_per_gpu: int = 4
    ppo_epochs: int = 1
    shuffle: bool = False
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = 0.2
    clip_ratio_high: Optional[float] = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: LossAggMode = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    grad_clip: float = 1.0
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    seed: int = 42


@dataclass
class RefConfig:
    """``actor_rollout_ref.ref.*``: the frozen reference policy."""

    log_prob_micro_batch_size_per_gpu: int = 8


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

    name: Literal["hf"] = "hf"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = True
    n: int = 1
    prompt_length: int = 128
    response_length: int = 16
    log_prob_micro_batch_size_per_gpu: int = 8
    micro_batch_size_per_gpu: int = 16
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)


@dataclass
class ActorRolloutRefConfig:
    """``actor_rollout_ref.*``: what ActorRolloutRefWorker receives."""

    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


@dataclass
class CriticModelConfig:
    """``critic.model.*``: the value-model backbone."""

    path: Optional[str] = None
    enable_gradient_checkpointing: bool = False


@dataclass
class CriticConfig:
    """``critic.*``: what CriticWorker receives (only built for GAE)."""

    strategy: Strategy = "fsdp2"
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    rollout_n: int = 1
    ppo_mini_batch_size: int = 4
    ppo_micro_batch_size_per_gpu: int = 4
    forward_micro_batch_size_per_gpu: int = 8
    ppo_epochs: int = 1
    shuffle: bool = False
    cliprange_value: float = 0.5
    loss_agg_mode: LossAggMode = "token-mean"
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
class AlgorithmConfig:
    """``algorithm.*``: advantage estimation and KL shaping."""

    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)


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
    critic_warmup: int = 0
    balance_batch: bool = True
    default_local_dir: str = "checkpoints/sead/default"
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    resume_from_path: Optional[str] = None
    max_ckpt_to_keep: Optional[int] = None
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
        """Whether a value model is trained (GAE only)."""
        return self.algorithm.adv_estimator == "gae"


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and convert containers/dataclasses; raise ConfigError."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return _build_dataclass(tp, value, key)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{key} must not be null")
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key} must be {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{key} must be one of {list(allowed)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    if value is None:
        raise ConfigError(f"{key} must not be null (expected {_type_name(tp)})")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    raise TypeError(f"unsupported annotation {tp!r} for {key}")


def _build_dataclass(cls: type, raw: Mapping[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in names:
            dotted = f"{prefix}.{key}" if prefix else str(key)
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {prefix + '.' if prefix else ''}{close[0]}?)" if close else ""
            raise ConfigError(f"{dotted} is not a config key{hint}")
    kwargs = {}
    for name in names:
        if name in raw:
            dotted = f"{prefix}.{name}" if prefix else name
            kwargs[name] = _coerce(raw[name], hints[name], dotted)
    return cls(**kwargs)


def to_container(cfg: Any) -> dict[str, Any]:
    """Return a plain, interpolation-resolved dict from a DictConfig or mapping."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    if isinstance(cfg, Mapping):
        return OmegaConf.to_container(OmegaConf.create(dict(cfg)), resolve=True, throw_on_missing=True)
    raise ConfigError(f"config must be a mapping, got {type(cfg).__name__}")


def build_config(cfg: Any) -> PPOTrainerConfig:
    """Type-check a job config (DictConfig or mapping) into a :class:`PPOTrainerConfig`; unknown keys fail."""
    return _build_dataclass(PPOTrainerConfig, to_container(cfg), "")


def _as_list(files: Optional[Union[str, list[str]]]) -> list[str]:
    if files is None:
        return []
    return [files] if isinstance(files, str) else list(files)


def _check_divisible(numerator: int, denominator: int, message: str) -> None:
    if denominator <= 0 or numerator % denominator != 0:
        raise ConfigError(message)


def _check_batch_sizes(cfg: PPOTrainerConfig) -> None:
    data, actor = cfg.data, cfg.actor_rollout_ref.actor
    n, world = cfg.actor_rollout_ref.rollout.n, cfg.world_size
    for key, value in [("data.train_batch_size", data.train_batch_size), ("actor_rollout_ref.rollout.n", n),
                       ("actor_rollout_ref.actor.ppo_mini_batch_size", actor.ppo_mini_batch_size),
                       ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", actor.ppo_micro_batch_size_per_gpu),
                       ("actor_rollout_ref.actor.ppo_epochs", actor.ppo_epochs),
                       ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
                        cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu),
                       ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                        cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu),
                       ("actor_rollout_ref.rollout.micro_batch_size_per_gpu",
                        cfg.actor_rollout_ref.rollout.micro_batch_size_per_gpu),
                       ("actor_rollout_ref.rollout.val_kwargs.n", cfg.actor_rollout_ref.rollout.val_kwargs.n),
                       ("trainer.nnodes", cfg.trainer.nnodes), ("trainer.n_gpus_per_node", cfg.trainer.n_gpus_per_node),
                       ("data.max_prompt_length", data.max_prompt_length),
                       ("data.max_response_length", data.max_response_length)]:
        if value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}")
    rows, mini_rows = data.train_batch_size * n, actor.ppo_mini_batch_size * n
    _check_divisible(rows, mini_rows, (
        f"data.train_batch_size * rollout.n ({data.train_batch_size}*{n}={rows}) must be divisible by "
        f"actor_rollout_ref.actor.ppo_mini_batch_size * rollout.n ({actor.ppo_mini_batch_size}*{n}={mini_rows})"))
    _check_divisible(rows, world, (
        f"data.train_batch_size * rollout.n ({data.train_batch_size}*{n}={rows}) must be divisible by the DP world "
        f"size trainer.nnodes * trainer.n_gpus_per_node ({cfg.trainer.nnodes}*{cfg.trainer.n_gpus_per_node}={world})"))
    _check_divisible(mini_rows, world, (
        f"actor_rollout_ref.actor.ppo_mini_batch_size * rollout.n ({mini_rows}) must be divisible by the DP world "
        f"size ({world})"))
    per_rank = mini_rows // world
    _check_divisible(per_rank, actor.ppo_micro_batch_size_per_gpu, (
        f"the actor mini-batch per rank ({mini_rows}/{world}={per_rank} rows) must be divisible by "
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu ({actor.ppo_micro_batch_size_per_gpu})"))
    if cfg.need_critic:
        critic = cfg.critic
        if critic.rollout_n != n:
            raise ConfigError(f"critic.rollout_n ({critic.rollout_n}) must equal actor_rollout_ref.rollout.n ({n})")
        c_rows = critic.ppo_mini_batch_size * n
        _check_divisible(rows, c_rows, (
            f"data.train_batch_size * rollout.n ({rows}) must be divisible by critic.ppo_mini_batch_size * "
            f"rollout.n ({critic.ppo_mini_batch_size}*{n}={c_rows})"))
        _check_divisible(c_rows, world, f"critic.ppo_mini_batch_size * rollout.n ({c_rows}) must be divisible by "
                                        f"the DP world size ({world})")
        _check_divisible(c_rows // world, critic.ppo_micro_batch_size_per_gpu, (
            f"the critic mini-batch per rank ({c_rows}/{world}={c_rows // world} rows) must be divisible by "
            f"critic.ppo_micro_batch_size_per_gpu ({critic.ppo_micro_batch_size_per_gpu})"))


def _check_paths(cfg: PPOTrainerConfig) -> None:
    model = cfg.actor_rollout_ref.model
    if not model.path:
        raise ConfigError("actor_rollout_ref.model.path is required: set it to a local Hugging Face model directory "
                          "(e.g. actor_rollout_ref.model.path=/path/to/model)")
    if not Path(model.path).is_dir():
        raise ConfigError(f"actor_rollout_ref.model.path={model.path!r} is not a directory")
    if model.tokenizer_path and not Path(model.tokenizer_path).is_dir():
        raise ConfigError(f"actor_rollout_ref.model.tokenizer_path={model.tokenizer_path!r} is not a directory")
    if cfg.need_critic and (not cfg.critic.model.path or not Path(cfg.critic.model.path).is_dir()):
        raise ConfigError(f"critic.model.path={cfg.critic.model.path!r} must be a local model directory "
                          f"(algorithm.adv_estimator=gae trains a critic)")
    train = _as_list(cfg.data.train_files)
    if not train:
        raise ConfigError("data.train_files is required: a parquet file or a list of them (the built-in task "
                          "writes them with `python -m verl.tasks.repeat_letter --out_dir DIR`)")
    for key, files in (("data.train_files", train), ("data.val_files", _as_list(cfg.data.val_files))):
        for f in files:
            if not Path(f).is_file():
                raise ConfigError(f"{key}: {f!r} does not exist")


def _check_choices(cfg: PPOTrainerConfig) -> None:
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY

    algo, actor = cfg.algorithm, cfg.actor_rollout_ref.actor
    if algo.adv_estimator not in ADV_ESTIMATOR_REGISTRY:
        raise ConfigError(f"algorithm.adv_estimator must be one of {sorted(ADV_ESTIMATOR_REGISTRY)}, "
                          f"got {algo.adv_estimator!r}")
    if algo.adv_estimator in GROUP_ESTIMATORS and cfg.actor_rollout_ref.rollout.n < 2:
        raise ConfigError(f"algorithm.adv_estimator={algo.adv_estimator} compares responses within a prompt group: "
                          f"set actor_rollout_ref.rollout.n >= 2 (got {cfg.actor_rollout_ref.rollout.n})")
    for key, value in (("algorithm.kl_penalty", algo.kl_penalty), ("actor_rollout_ref.actor.kl_loss_type",
                                                                   actor.kl_loss_type)):
        if value.rstrip("+") not in KL_ESTIMATORS:
            raise ConfigError(f"{key} must be one of {list(KL_ESTIMATORS)} (optionally with a '+' suffix), "
                              f"got {value!r}")
    for i, name in enumerate(cfg.trainer.logger):
        if name not in LOGGERS:
            raise ConfigError(f"trainer.logger[{i}] must be one of {list(LOGGERS)}, got {name!r}")
    if cfg.trainer.resume_mode == "resume_path" and not cfg.trainer.resume_from_path:
        raise ConfigError("trainer.resume_mode=resume_path needs trainer.resume_from_path")
    if cfg.trainer.total_training_steps is not None and cfg.trainer.total_training_steps <= 0:
        raise ConfigError(f"trainer.total_training_steps must be positive or null, got "
                          f"{cfg.trainer.total_training_steps}")
    if cfg.trainer.total_epochs <= 0:
        raise ConfigError(f"trainer.total_epochs must be positive, got {cfg.trainer.total_epochs}")
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.prompt_length != cfg.data.max_prompt_length:
        raise ConfigError(f"actor_rollout_ref.rollout.prompt_length ({rollout.prompt_length}) must equal "
                          f"data.max_prompt_length ({cfg.data.max_prompt_length})")
    if rollout.response_length != cfg.data.max_response_length:
        raise ConfigError(f"actor_rollout_ref.rollout.response_length ({rollout.response_length}) must equal "
                          f"data.max_response_length ({cfg.data.max_response_length})")
    if "." not in cfg.reward.path:
        raise ConfigError(f"reward.path must be a dotted path module.function, got {cfg.reward.path!r}")
    if cfg.rollout_loop.path is not None and "." not in cfg.rollout_loop.path:
        raise ConfigError(f"rollout_loop.path must be a dotted path module.Class, got {cfg.rollout_loop.path!r}")
    if actor.use_kl_loss and algo.use_kl_in_reward:
        logger.warning("both actor_rollout_ref.actor.use_kl_loss and algorithm.use_kl_in_reward are on: "
                       "the KL is penalised twice")


def validate_config(cfg: PPOTrainerConfig, check_paths: bool = True) -> None:
    """Cross-field checks (required paths, divisibility by mini-batch and DP world size, enumerations)."""
    if check_paths:
        _check_paths(cfg)
    _check_choices(cfg)
    _check_batch_sizes(cfg)


def load_config(cfg: Any, check_paths: bool = True) -> PPOTrainerConfig:
    """``build_config`` followed by ``validate_config``; the one call the entry point and the trainer use."""
    typed = build_config(cfg)
    validate_config(typed, check_paths=check_paths)
    return typed


def compose_config(overrides: Optional[list[str]] = None) -> Any:
    """Compose ``ppo_trainer.yaml`` with Hydra command-line style overrides and return the job DictConfig."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name=CONFIG_NAME, overrides=list(overrides or []))
