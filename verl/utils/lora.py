"""LoRA adapters (PEFT) on the workers' models: settings, injection, names, the adapter's files and merging.

veRL's keys (``actor_rollout_ref.model`` / ``critic.model``): ``lora_rank`` (0 = off), ``lora_alpha``,
``target_modules`` (``all-linear``: every linear layer of the decoder, not the LM head; or a list of module names)
and, for the actor, ``exclude_modules`` and ``lora.merge``. A LoRA model is a PEFT ``PeftModel`` around the HF
model: the frozen base keeps its HF parameters (``base_model.model.<hf name>``, the wrapped linear layers'
under ``<module>.base_layer``), the adapter adds ``<module>.lora_A.<adapter>`` / ``lora_B.<adapter>`` and, for a
value model, a trained copy of the value head (PEFT's ``modules_to_save``).

The adapter's files are PEFT's (``adapter_config.json``, ``adapter_model.safetensors`` with PEFT's saved names,
e.g. ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``): ``PeftModel.from_pretrained`` and
vLLM's ``LoRARequest`` load them as they are.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

ALL_LINEAR = "all-linear"
ADAPTER_NAME = "default"  # PEFT's name of the one adapter a model carries
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the HF names
BASE_LAYER = ".base_layer"  # a wrapped linear layer's frozen original
LORA_FACTORS = ("lora_A", "lora_B")
# The value head of AutoModelForTokenClassification (Qwen2/Llama: score) is trained whole, never a LoRA target.
VALUE_HEAD_NAMES = ("score", "classifier")
TASK_TYPES = {"causal_lm": "CAUSAL_LM", "token_cls": "TOKEN_CLS"}


def _module_names(value: Any, key: str, allow_all_linear: bool) -> str | tuple[str, ...]:
    """``all-linear`` or a tuple of module names from a config value (a name alone is a list of one)."""
    if isinstance(value, str):
        if value == ALL_LINEAR and allow_all_linear:
            return ALL_LINEAR
        value = [value]
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{key} must be {'all-linear or ' if allow_all_linear else ''}a non-empty list of module "
                         f"names, got {value!r}")
    names = []
    for i, name in enumerate(value):
        if not isinstance(name, str) or not name.strip() or name != name.strip() or name == ALL_LINEAR:
            raise ValueError(f"{key}[{i}] must be a module name (e.g. q_proj), got {name!r}")
        names.append(name)
    if len(set(names)) != len(names):
        raise ValueError(f"{key} names a module twice: {names}")
    return tuple(names)


@dataclass(frozen=True)
class LoraSettings:
    """The LoRA adapter of one model: rank r, alpha (the update is alpha / r * B @ A), the modules it adapts and
    those it leaves alone, and (actor with vLLM) whether the rollout engine gets merged weights instead."""

    rank: int
    alpha: float
    target_modules: str | tuple[str, ...] = ALL_LINEAR
    exclude_modules: tuple[str, ...] = ()
    merge: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"lora_rank must be a positive integer to use LoRA, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha) \
                or self.alpha <= 0:
            raise ValueError(f"lora_alpha must be a finite number > 0, got {self.alpha!r}")

    @classmethod
    def from_model_config(cls, model_cfg: Any, where: str) -> LoraSettings | None:
        """The settings of a ``model`` config block (``where``: its dotted name, in errors); None when
        ``lora_rank`` is 0 or absent."""
        rank = model_cfg.get("lora_rank", 0) or 0
        if rank == 0:
            return None
        excluded = model_cfg.get("exclude_modules", None)
        lora = model_cfg.get("lora", None) or {}
        try:
            return cls(rank=rank, alpha=model_cfg.get("lora_alpha", 16),
                       target_modules=_module_names(model_cfg.get("target_modules", ALL_LINEAR),
                                                    f"{where}.target_modules", True),
                       exclude_modules=() if excluded is None else _module_names(excluded, f"{where}.exclude_modules",
                                                                                 False),
                       merge=bool(lora.get("merge", False)))
        except ValueError as exc:
            message = str(exc)
            raise ValueError(message if message.startswith(where) else f"{where}.{message}") from None

    @property
    def scaling(self) -> float:
        """alpha / r: the factor of B @ A in the adapted weight."""
        return float(self.alpha) / self.rank


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """Distinct leaf names of the model's ``nn.Linear`` layers, the LM head excepted (what ``all-linear`` adapts)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
             if isinstance(module, torch.nn.Linear) and module is not head}
    return sorted(names)


def check_target_modules(model: torch.nn.Module, settings: LoraSettings, where: str) -> None:
    """Raise naming the ``target_modules`` / ``exclude_modules`` entries that are no linear layer of ``model``
    (PEFT would silently skip them)."""
    known = set(linear_module_names(model))
    for key, names in (("target_modules", settings.target_modules), ("exclude_modules", settings.exclude_modules)):
        if names == ALL_LINEAR:
            continue
        unknown = [name for name in names if name not in known]
        if unknown:
            raise ValueError(f"{where}.{key}: {unknown} name no linear layer of {type(model).__name__}; its linear "
                             f"layers are {sorted(known)}")


def apply_lora(model: torch.nn.Module, settings: LoraSettings, task: str, where: str) -> torch.nn.Module:
    """Wrap ``model`` (an HF causal LM, ``task="causal_lm"``, or value model, ``"token_cls"``) in a PEFT model with a
    fresh adapter (B = 0: the adapted model starts equal to the base). Only the adapter (and a value model's head)
    requires gradients; those parameters are float32, the frozen base keeps its dtype."""
    from peft import LoraConfig, get_peft_model

    check_target_modules(model, settings, where)
    excluded = list(settings.exclude_modules)
    if task == "token_cls":  # the head is trained whole (modules_to_save), so all-linear must not adapt it
        excluded += [name for name in VALUE_HEAD_NAMES if name not in excluded]
    target = settings.target_modules if settings.target_modules == ALL_LINEAR else list(settings.target_modules)
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, target_modules=target,
                        exclude_modules=excluded or None, lora_dropout=0.0, bias="none", task_type=TASK_TYPES[task])
    peft_model = get_peft_model(model, config)
    for param in peft_model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    logger.info("%s: LoRA rank %d, alpha %g on %s: %d trainable of %d parameters", where, settings.rank,
                settings.alpha, sorted(peft_model.peft_config[ADAPTER_NAME].target_modules), trainable, total)
    return peft_model


def peft_model_of(module: torch.nn.Module) -> torch.nn.Module | None:
    """``module`` itself when it is a PEFT model (FSDP2 keeps the class as a base of its wrapper), else None."""
    from peft import PeftModel

    return module if isinstance(module, PeftModel) else None


@contextlib.contextmanager
def adapters_disabled(module: torch.nn.Module) -> Iterator[None]:
    """Run ``module`` as its base model inside the block (PEFT's ``disable_adapter``): the reference policy of a
    LoRA actor, without a second copy of the base weights."""
    peft_model = peft_model_of(module)
    if peft_model is None:
        raise ValueError(f"{type(module).__name__} carries no LoRA adapter to disable")
    with peft_model.disable_adapter():
        yield


def is_adapter_parameter(name: str) -> bool:
    """Whether a PEFT model's parameter ``name`` belongs to a LoRA factor (not the frozen base)."""
    return any(f".{factor}." in name for factor in LORA_FACTORS)


def base_parameter_name(name: str) -> str:
    """The HF name of a PEFT model's base parameter (``base_model.model.`` and ``.base_layer`` removed)."""
    name = name.removeprefix(PEFT_PREFIX)
    return name.replace(BASE_LAYER + ".", ".")


def adapter_tensor_name(name: str) -> str:
    """PEFT's saved name of a LoRA factor parameter (``...q_proj.lora_A.default.weight`` ->
    ``...q_proj.lora_A.weight``), the name vLLM and ``PeftModel.from_pretrained`` read."""
    for factor in LORA_FACTORS:
        name = name.replace(f".{factor}.{ADAPTER_NAME}.", f".{factor}.")
    return name


def adapter_config(module: torch.nn.Module, base_model_path: str | None = None) -> dict[str, Any]:
    """The adapter's PEFT config as the JSON object of ``adapter_config.json`` (target modules resolved to names,
    ``base_model_name_or_path`` = ``base_model_path`` when given)."""
    peft_model = peft_model_of(module)
    if peft_model is None:
        raise ValueError(f"{type(module).__name__} carries no LoRA adapter")
    config = peft_model.peft_config[ADAPTER_NAME]
    data = json.loads(json.dumps(config.to_dict(), default=_json_default))
    if base_model_path is not None:
        data["base_model_name_or_path"] = str(base_model_path)
    return data


def _json_default(value: Any) -> Any:
    """JSON for the set and enum values of a PEFT config."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if hasattr(value, "value"):
        return value.value
    raise TypeError(f"cannot write {type(value).__name__} to adapter_config.json")


def peft_saved_state(peft_model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT's saved form (the names of ``adapter_model.safetensors``) of ``state``, a dict of the PEFT model's own
    trainable parameters by their names (e.g. a gathered state dict)."""
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(peft_model, state_dict=state, adapter_name=ADAPTER_NAME,
                                     save_embedding_layers=False)


def save_adapter(path: str | os.PathLike, tensors: dict[str, torch.Tensor] | None, config: dict[str, Any]) -> None:
    """Write ``adapter_config.json`` and, when ``tensors`` is given, ``adapter_model.safetensors`` into ``path``."""
    from safetensors.torch import save_file

    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if tensors is not None:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(directory / ADAPTER_WEIGHTS_FILE),
                  metadata={"format": "pt"})


def read_adapter_config(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed ``adapter_config.json`` of ``path``; ValueError naming the file when it is not a LoRA config."""
    file = Path(path) / ADAPTER_CONFIG_FILE
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file}: not a readable adapter config ({exc})") from None
    if not isinstance(data, dict) or data.get("peft_type") != "LORA" or not isinstance(data.get("r"), int):
        raise ValueError(f"{file}: not a LoRA adapter config (peft_type LORA with an integer r)")
    return data


def is_adapter_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds an ``adapter_config.json`` (a LoRA adapter or a LoRA checkpoint's actor/)."""
    return (Path(path) / ADAPTER_CONFIG_FILE).is_file()


def merged_weight_stream(params: Iterable[tuple[str, torch.Tensor]], scaling: float,
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """HF ``(name, tensor)`` pairs of the merged model from a PEFT model's ``(name, full tensor)`` pairs in module
    order: an adapted layer's weight becomes W + scaling * B @ A (computed in float32, returned in W's dtype), the
    other parameters pass under their HF names. A layer's base weight and factors arrive together (PEFT registers
    them in the same module), so at most one layer is held."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in params:
        for part in (BASE_LAYER + ".weight",) + tuple(f".{f}.{ADAPTER_NAME}.weight" for f in LORA_FACTORS):
            if name.endswith(part):
                module = name[: -len(part)]
                layer = pending.setdefault(module, {})
                layer[part] = tensor
                if len(layer) == 3:
                    del pending[module]
                    yield base_parameter_name(module) + ".weight", _merged(layer, scaling)
                break
        else:
            yield base_parameter_name(name), tensor
    if pending:
        raise ValueError(f"LoRA layers without their base weight or both factors: {sorted(pending)[:4]}")


def _merged(layer: dict[str, torch.Tensor], scaling: float) -> torch.Tensor:
    weight = layer[BASE_LAYER + ".weight"]
    lora_a, lora_b = (layer[f".{f}.{ADAPTER_NAME}.weight"] for f in LORA_FACTORS)
    return (weight.float() + scaling * (lora_b.float() @ lora_a.float())).to(weight.dtype)
