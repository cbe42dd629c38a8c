"""FSDP helpers: wrapping, gradient clipping, generation, full-state-dict HF export and exact resume state.

Two strategies: ``fsdp2`` (``fully_shard``, the default) and ``fsdp`` (FSDP1 ``FullyShardedDataParallel``).
Everything also works on CPU with gloo (ENVIRONMENT.md §3): no pinned memory or CPU offload, FSDP1 gets
``device_id=cpu`` and ``sync_module_states=False`` (every rank loads the same weights instead), and the full
state dict is only offloaded to CPU on CUDA (offloading on CPU crashes FSDP1).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecision,
    MixedPrecisionPolicy,
    ShardingStrategy,
    fully_shard,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, GenerationConfig

from verl.utils.file_modes import weights_like_the_rest
from verl.utils.lora import LoraSettings, apply_lora
from verl.utils.safe_dcp import load_dcp

logger = logging.getLogger(__name__)

SUPPORTED_STRATEGIES = ("fsdp2", "fsdp")
_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}
SHARDED_STATE_DIR = "sharded_state"
# Attribute of an FSDP2 root module holding the reshard_after_forward it was wrapped with (restored after generation).
RESHARD_AFTER_FORWARD_ATTR = "_sead_reshard_after_forward"


def check_strategy(strategy: str, where: str) -> None:
    """Raise a clear error unless ``strategy`` (read from config key ``where``) is a supported FSDP strategy."""
    if strategy not in SUPPORTED_STRATEGIES:
        raise ValueError(f"{where}={strategy!r} is not supported; expected one of {list(SUPPORTED_STRATEGIES)}")


def resolve_param_dtype(name: str | None, device_type: str) -> torch.dtype:
    """Map ``fsdp_config.param_dtype`` to a dtype: ``auto`` is bf16 on CUDA and fp32 elsewhere."""
    if name is None or name == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"fsdp_config.param_dtype must be auto or one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def resolve_attn_implementation(name: str | None, device_type: str, param_dtype: torch.dtype) -> str:
    """The HF attention kernel for ``model.attn_implementation``: ``auto`` is ``flash_attention_2`` when training
    computes in bf16/fp16 on CUDA and the flash-attn package is installed (the ``gpu`` extra), else ``sdpa``;
    an explicit ``flash_attention_2`` that cannot run fails here, naming the key."""
    usable = (device_type == "cuda" and param_dtype in (torch.bfloat16, torch.float16)
              and importlib.util.find_spec("flash_attn") is not None)
    if name is None or name == "auto":
        return "flash_attention_2" if usable else "sdpa"
    if name == "flash_attention_2" and not usable:
        raise ValueError("model.attn_implementation=flash_attention_2 needs a CUDA device, fsdp_config.param_dtype "
                         "bf16 and the flash-attn package (pip install -e '.[gpu]'); use auto or sdpa")
    return name


def create_device_mesh(device_type: str) -> DeviceMesh:
    """A 1-D data-parallel mesh named ``fsdp`` over all ranks of the default process group."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call Worker.init_distributed() before wrapping")
    return init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("fsdp",))


def transformer_layer_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's transformer blocks: submodules whose class is listed in HF ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"cannot find transformer layers to shard in {type(model).__name__}: "
            f"its _no_split_modules is {sorted(names)}"
        )
    return layers


def apply_fsdp2(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reshard_after_forward: bool = True,
) -> torch.nn.Module:
    """Shard ``model`` in place with FSDP2: each transformer layer, the input embedding and the output head as
    units of their own, then the root (final norm, a small value head).

    Tied embeddings (one parameter used by embedding and head) cannot be split over two units and stay in the
    root. Parameters keep their dtype (fp32 master weights for a trained model); forward/backward run in
    ``param_dtype`` and gradients are reduced in fp32. ``fully_shard`` moves the shards to the mesh's device.
    """
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=True)
    for unit in transformer_layer_modules(model) + embedding_units(model):
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    setattr(model, RESHARD_AFTER_FORWARD_ATTR, reshard_after_forward)
    return model


@torch.no_grad()
def settle_fsdp_root(model: torch.nn.Module, device: torch.device) -> None:
    """Run one single-token forward through an FSDP2 ``model`` and reshard it, so that FSDP2 takes it as the root.

    FSDP2 takes as its root the first unit whose forward runs. A PEFT model's ``generate`` enters the HF model
    inside it directly, so generating before any forward (the first rollout) would make a decoder layer the root.
    A collective: every rank calls it."""
    model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def embedding_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The input embedding and the LM head when they share no parameter (else none: both stay in the root).

    At 7B they hold 1.09B parameters; in the root unit they would stay gathered for the whole forward and
    backward pass. A head without the ``get_output_embeddings`` hook (e.g. a value head) stays in the root.
    """
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if embedding is None:
        return []
    if head is None:
        return [embedding]
    shared = {id(p) for p in embedding.parameters()} & {id(p) for p in head.parameters()}
    return [] if shared else [embedding, head]


def apply_fsdp1(
    model: torch.nn.Module, device_type: str, param_dtype: torch.dtype, reshard_after_forward: bool = True
) -> FSDP:
    """Wrap ``model`` with FSDP1: one FSDP unit per transformer layer plus the root, ``use_orig_params=True``.

    ``reshard_after_forward`` picks FULL_SHARD (True) or SHARD_GRAD_OP (False). Parameters stay fp32; compute
    runs in ``param_dtype`` with fp32 gradient reduction and buffers. Every unit casts its inputs, since
    generation (see :func:`generation_model`) bypasses the root unit's forward, which otherwise does it.
    """
    layer_classes = {type(layer) for layer in transformer_layer_modules(model)}
    device_id = torch.device("cpu") if device_type == "cpu" else torch.device(device_type, torch.cuda.current_device())
    return FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layer_classes),
        mixed_precision=MixedPrecision(
            param_dtype=param_dtype, reduce_dtype=torch.float32, buffer_dtype=torch.float32, cast_forward_inputs=True
        ),
        sharding_strategy=ShardingStrategy.FULL_SHARD if reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP,
        device_id=device_id,
        sync_module_states=False,
        use_orig_params=True,
    )


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model inside an FSDP1 wrapper (FSDP2 models are their own HF model)."""
    return model.module if isinstance(model, FSDP) else model


@contextlib.contextmanager
def generation_model(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Yield the module whose ``generate`` to call on a sharded model.

    FSDP2: every unit is gathered once on entry and stays gathered for the whole call (resharding after
    forward is off meanwhile), so decoding a token costs no all-gather; on exit the units are resharded and the
    configured ``reshard_after_forward`` is restored. The whole model in the compute dtype is then held for the
    duration. FSDP1 only unshards in its own ``forward`` while HF ``generate`` calls the inner model: the root
    unit's parameters (embeddings, final norm, head) are gathered for the duration, the per-layer units still
    gather in their forward (FSDP1 cannot run a unit's forward inside ``summon_full_params``).
    """
    if isinstance(model, FSDP):
        with FSDP.summon_full_params(model, recurse=False, writeback=False):
            yield model.module
        return
    if not isinstance(model, FSDPModule):
        yield model
        return
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    model.set_reshard_after_forward(False)
    for unit in units:
        unit.unshard()
    try:
        yield model
    finally:
        model.set_reshard_after_forward(bool(getattr(model, RESHARD_AFTER_FORWARD_ATTR, True)))
        for unit in units:
            unit.reshard()


def _load_weights(
    auto_cls: type, model_path: str, hf_config: Any, dtype: torch.dtype, attn_implementation: str, on_meta: bool
) -> torch.nn.Module:
    """``from_pretrained`` on the CPU, or (``on_meta``) an empty skeleton of the same model on the meta device."""
    if not on_meta:
        return auto_cls.from_pretrained(
            model_path, config=hf_config, dtype=dtype, attn_implementation=attn_implementation
        )
    with torch.device("meta"):
        model = auto_cls.from_config(hf_config, dtype=dtype, attn_implementation=attn_implementation)
    with contextlib.suppress(OSError):  # a model directory without generation_config.json keeps the default
        model.generation_config = GenerationConfig.from_pretrained(model_path)
    return model


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute every decoder layer's activations in the backward pass (non-reentrant ``torch.utils.checkpoint``).

    transformers names the switch ``activation_checkpointing_enable`` from 5.23 and ``gradient_checkpointing_enable``
    before (a deprecated alias since, to be removed in v6): the feature is detected, not the version.
    """
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def broadcast_from_rank0(model: torch.nn.Module, full_state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Fill an FSDP2 model's shards on every rank from rank 0's full state dict (empty on the other ranks).

    Ranks > 0 hold a meta-device skeleton, materialised (uninitialised) on ``device`` first; buffers, which are
    not all in the state dict (e.g. rotary ``inv_freq``), are broadcast from rank 0 as well. A collective.
    """
    if dist.get_rank() != 0:
        model.to_empty(device=device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full_state, options=options)
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


def build_fsdp_model(
    auto_cls: type,
    model_path: str,
    mesh: DeviceMesh,
    fsdp_config: Any,
    seed: int,
    attn_implementation: str = "auto",
    gradient_checkpointing: bool = False,
    config_overrides: dict[str, Any] | None = None,
    strategy: str = "fsdp2",
    master_dtype: torch.dtype = torch.float32,
    lora: LoraSettings | None = None,
    lora_task: str = "causal_lm",
    lora_where: str = "model",
) -> torch.nn.Module:
    """Load ``auto_cls.from_pretrained(model_path)`` with parameters in ``master_dtype`` and shard it.

    ``master_dtype`` is what the sharded parameters are kept in: fp32 for a trained model (the optimizer's master
    copy), the compute dtype for a frozen one (the reference policy, a LoRA model's base). With ``lora`` the model
    becomes a PEFT model with a fresh float32 adapter (:func:`verl.utils.lora.apply_lora`, ``lora_task`` causal_lm or
    token_cls, ``lora_where`` the config block in errors) before it is sharded: the frozen base and the adapter of a
    layer share its FSDP2 unit. ``torch.manual_seed(seed)`` runs first, so
    weights the checkpoint lacks (e.g. a new value head, the adapter's A) are initialised reproducibly. With ``fsdp2`` only rank 0
    reads the checkpoint into host memory; the other ranks build the model on the meta device and receive their
    shards from rank 0 (:func:`broadcast_from_rank0`). With ``fsdp`` (FSDP1) every rank loads the full model.
    ``fsdp_config`` supplies ``param_dtype`` (auto | fp32 | bf16) and ``reshard_after_forward``;
    ``config_overrides`` are set on the HF config before the model is built (e.g. ``num_labels``);
    ``attn_implementation`` is resolved by :func:`resolve_attn_implementation`.
    """
    check_strategy(strategy, "strategy")
    if not os.path.isdir(model_path):
        raise FileNotFoundError(f"model.path={model_path!r} is not a local directory (nothing is downloaded)")
    hf_config = AutoConfig.from_pretrained(model_path)
    for key, value in (config_overrides or {}).items():
        setattr(hf_config, key, value)
    param_dtype = resolve_param_dtype(fsdp_config.get("param_dtype", "auto"), mesh.device_type)
    attn = resolve_attn_implementation(attn_implementation, mesh.device_type, param_dtype)
    torch.manual_seed(seed)
    rank0_only = strategy == "fsdp2" and dist.get_world_size() > 1
    on_meta = rank0_only and dist.get_rank() != 0
    model = _load_weights(auto_cls, model_path, hf_config, master_dtype, attn, on_meta)
    if gradient_checkpointing:
        enable_activation_checkpointing(model)
    if lora is not None:
        if strategy != "fsdp2":
            raise ValueError(f"{lora_where}.lora_rank needs the fsdp2 strategy, got {strategy!r}")
        model = apply_lora(model, lora, lora_task, lora_where)
    full_state = model.state_dict() if rank0_only and not on_meta else {}
    reshard = bool(fsdp_config.get("reshard_after_forward", True))
    logger.info("%s-wrapping %s from %s (param_dtype=%s, master_dtype=%s, attention %s)", strategy,
                type(model).__name__, model_path, param_dtype, master_dtype, attn)
    if strategy == "fsdp":
        return apply_fsdp1(model, mesh.device_type, param_dtype, reshard_after_forward=reshard)
    model = apply_fsdp2(model, mesh, param_dtype, reshard_after_forward=reshard)
    device = torch.device("cpu") if mesh.device_type == "cpu" else torch.device("cuda", torch.cuda.current_device())
    if rank0_only:
        broadcast_from_rank0(model, full_state, device)
    if lora is not None:
        settle_fsdp_root(model, device)
    return model


def clip_grad_norm(model: torch.nn.Module, max_norm: float | None) -> float:
    """Clip the gradients' global L2 norm to ``max_norm`` (None or <= 0: no clipping) and return the norm.

    FSDP1 reduces the norm over its shards in ``model.clip_grad_norm_``; with FSDP2 the norm is a DTensor
    reduced over the mesh, made a plain number with ``.full_tensor()``. A non-finite norm is returned as is
    (the caller then skips the step).
    """
    limit = float(max_norm) if max_norm is not None and max_norm > 0 else float("inf")
    if isinstance(model, FSDP):
        return float(model.clip_grad_norm_(limit))
    params = [p for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.clip_grad_norm_(params, max_norm=limit, error_if_nonfinite=False)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    return float(total)


def full_state_dict(model: torch.nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Gather the unsharded state dict on every rank (a collective: all ranks must call it); ``trainable_only``
    leaves out the frozen parameters (a LoRA model's base).

    On CUDA it is offloaded to CPU; on CPU offloading is skipped (it would crash FSDP1, ENVIRONMENT.md §3).
    """
    on_cuda = next(model.parameters()).device.type == "cuda"
    options = StateDictOptions(full_state_dict=True, cpu_offload=on_cuda, ignore_frozen_params=trainable_only)
    state = get_model_state_dict(model, options=options)
    return _without_frozen_aliases(model, state) if trainable_only else state


def _without_frozen_aliases(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` without the keys of frozen parameters: ``ignore_frozen_params`` keeps a frozen tied parameter under
    its second name (e.g. a tied ``lm_head.weight``)."""
    trainable = {name for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    return {key: value for key, value in state.items() if key in trainable}


def save_hf_pretrained(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """Write ``state_dict`` as an HF ``save_pretrained`` directory (safetensors + config) at ``path``.

    A skeleton of the model's own class is built on the meta device, so nothing is allocated and the exported
    ``config.json`` names the HF class, not the FSDP wrapper subclass.
    """
    model = unwrap_model(model)
    hf_cls = _hf_class(model)
    with torch.device("meta"):
        skeleton = hf_cls._from_config(model.config)
    skeleton.save_pretrained(str(path), state_dict=state_dict, safe_serialization=True)
    weights_like_the_rest(path)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(str(path))


def save_hf_config(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Write the model's HF ``config.json`` (naming its HF class) and generation config, without weights."""
    model = unwrap_model(model)
    config = model.config
    config.architectures = [_hf_class(model).__name__]
    config.save_pretrained(str(path))
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(str(path))


def _hf_class(model: torch.nn.Module) -> type:
    """The HF model class of ``model``, looking through FSDP2's dynamically created ``FSDP<Class>`` subclass."""
    cls = type(model)
    for base in cls.__mro__:
        if base.__name__ == cls.__name__.removeprefix("FSDP") and hasattr(base, "_from_config"):
            return base
    raise TypeError(f"{cls.__name__} is not a transformers PreTrainedModel")


def _model_state(model: torch.nn.Module, trainable_only: bool) -> dict[str, Any]:
    """The sharded model state (its trainable parameters only, with ``trainable_only``)."""
    if not trainable_only:
        return get_model_state_dict(model)
    return _without_frozen_aliases(model, get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True)))


def save_sharded_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike,
    process_group: dist.ProcessGroup | None = None, trainable_only: bool = False,
) -> None:
    """Save the sharded model (and optimizer) state with torch.distributed.checkpoint under ``path/sharded_state``.

    A collective: every rank writes its own shards, which :func:`load_sharded_state` restores exactly.
    ``process_group`` carries the save's coordination (default: the default group). ``trainable_only`` leaves the
    frozen parameters out (a LoRA model's base, which the run reloads from its model path).
    """
    state: dict[str, Any] = {"model": _model_state(model, trainable_only)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    dcp.save(state, checkpoint_id=str(Path(path) / SHARDED_STATE_DIR), process_group=process_group)


def load_sharded_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike,
    process_group: dist.ProcessGroup | None = None, trainable_only: bool = False,
) -> None:
    """Restore what :func:`save_sharded_state` wrote at ``path`` into ``model`` (and ``optimizer``), with the same
    ``trainable_only``: then the frozen parameters keep their values and every trainable one must be restored.
    The files are read by :mod:`verl.utils.safe_dcp`: nothing in them runs as code."""
    ckpt_dir = Path(path) / SHARDED_STATE_DIR
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"no sharded model/optimizer state at {ckpt_dir} (written by save_checkpoint)")
    state: dict[str, Any] = {"model": _model_state(model, trainable_only)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    load_dcp(state, ckpt_dir, process_group=process_group)
    if trainable_only:
        result = set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
        frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
        restored_wrongly = set(result.unexpected_keys) | (set(result.missing_keys) - frozen)
        if restored_wrongly:
            raise RuntimeError(f"{ckpt_dir}: trainable parameters not restored: {sorted(restored_wrongly)[:5]}")
    else:
        set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])
