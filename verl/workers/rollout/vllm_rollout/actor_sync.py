"""What an actor sends its colocated vLLM engine after start, an update or a checkpoint load.

- a fully trained actor: every weight (:func:`fsdp_weight_stream`);
- a LoRA actor whose engine serves the adapter: the frozen base under its HF names while the engine lacks it (at
  start), then the adapter's factors under PEFT's saved names with the adapter's PEFT config;
- a LoRA actor with ``model.lora.merge``: every weight, the adapted ones merged (W + alpha / r * B @ A).

Every rank of the actor's process group calls it together (the gathers are collectives).
"""

from __future__ import annotations

from typing import Any

import torch

from verl.utils.lora import (LoraSettings, adapter_config, adapter_tensor_name, base_parameter_name,
                             is_adapter_parameter, merged_weight_stream)
from verl.workers.rollout.vllm_rollout.weight_sync import WeightSyncStats, fsdp_weight_stream


def _is_base_parameter(name: str) -> bool:
    return not is_adapter_parameter(name)


def sync_actor_weights(module: torch.nn.Module, rollout: Any, stats: WeightSyncStats, lora: LoraSettings | None,
                       base_model_path: str | None = None) -> None:
    """Send ``module``'s (the FSDP actor's) weights to ``rollout`` (a :class:`vLLMRollout`) as the module docstring
    says; ``stats`` gathers what moved and the time; ``base_model_path`` is recorded in the adapter's config."""
    dtype, bucket = rollout.weight_dtype, rollout.bucket_bytes
    if lora is None:
        rollout.update_weights(fsdp_weight_stream(module, dtype, stats, bucket), stats)
        return
    if lora.merge:
        rollout.update_weights(merged_weight_stream(fsdp_weight_stream(module, dtype, stats, bucket), lora.scaling),
                               stats)
        return
    if not rollout.base_loaded:
        base = fsdp_weight_stream(module, dtype, stats, bucket, select=_is_base_parameter)
        rollout.update_weights(((base_parameter_name(name), tensor) for name, tensor in base), stats)
    factors = fsdp_weight_stream(module, dtype, stats, bucket, select=is_adapter_parameter)
    rollout.update_adapter(((adapter_tensor_name(name), tensor) for name, tensor in factors),
                           adapter_config(module, base_model_path), stats)
