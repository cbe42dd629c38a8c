"""The LoRA side of ``python -m verl.trainer.plan``: which layers an adapter covers and how large it is.

``target_modules`` / ``exclude_modules`` resolve against the decoder's linear layers of the memory model
(:attr:`verl.utils.memory_model.ModelShape.linear_layers`, Qwen2 / Llama names) as PEFT resolves them against the
model: ``all-linear`` is every linear layer of a decoder layer (not the LM head). A name that is no such layer is a
:class:`ConfigError` naming the key. The vLLM engine of a LoRA actor allocates its adapter slot for every linear
layer it can adapt, at ``max_lora_rank`` (the adapter's rank rounded up to vLLM's list).
"""
from __future__ import annotations

from dataclasses import dataclass

from verl.trainer.config_schema import ConfigError
from verl.trainer.config_validation import VLLM_MAX_LORA_RANK
from verl.utils import memory_model as mm
from verl.utils.lora import ALL_LINEAR, LoraSettings

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, VLLM_MAX_LORA_RANK)  # vLLM 0.32's max_lora_rank values


@dataclass(frozen=True)
class LoraPlan:
    """A model's adapter in the plan: its settings, the adapted decoder layers and its parameter count."""

    settings: LoraSettings
    modules: tuple[str, ...]
    params: int

    def share(self, shape: mm.ModelShape) -> float:
        """The adapter's parameters as a fraction of the model's."""
        return self.params / shape.num_params()


def lora_plan(model_cfg, shape: mm.ModelShape, where: str) -> LoraPlan | None:
    """The adapter of a ``model`` config block (``where``: its dotted name) on ``shape``; None without LoRA."""
    settings = LoraSettings.from_model_config(
        {"lora_rank": model_cfg.lora_rank, "lora_alpha": model_cfg.lora_alpha,
         "target_modules": model_cfg.target_modules, "exclude_modules": getattr(model_cfg, "exclude_modules", None),
         "lora": {"merge": getattr(getattr(model_cfg, "lora", None), "merge", False)}}, where)
    if settings is None:
        return None
    known = set(shape.linear_layers)
    for key, names in (("target_modules", settings.target_modules), ("exclude_modules", settings.exclude_modules)):
        unknown = [] if names == ALL_LINEAR else [n for n in names if n not in known]
        if unknown:
            raise ConfigError(f"{where}.{key}: {unknown} name no linear layer of the model's decoder layers "
                              f"({sorted(known)})")
    targets = known if settings.target_modules == ALL_LINEAR else set(settings.target_modules)
    modules = tuple(sorted(targets - set(settings.exclude_modules)))
    if not modules:
        raise ConfigError(f"{where}: exclude_modules removes every target module: the adapter would adapt nothing")
    return LoraPlan(settings=settings, modules=modules, params=shape.lora_params(settings.rank, modules))


def vllm_max_lora_rank(rank: int) -> int:
    """vLLM's ``max_lora_rank`` for an adapter of ``rank`` (the smallest listed value that holds it)."""
    fitting = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fitting:
        raise ConfigError(f"actor_rollout_ref.model.lora_rank={rank}: vLLM serves adapters of rank <= "
                          f"{VLLM_LORA_RANKS[-1]}")
    return fitting[0]


def vllm_adapter_slot_bytes(shape: mm.ModelShape, rank: int, dtype_bytes: int, tp: int) -> float:
    """Bytes per GPU of a vLLM engine's one adapter slot: A and B of every linear layer at ``max_lora_rank``."""
    every_layer = shape.lora_params(vllm_max_lora_rank(rank), shape.linear_layers)
    return every_layer * dtype_bytes / tp
