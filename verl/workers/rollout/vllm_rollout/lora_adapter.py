"""A LoRA adapter handed to the colocated vLLM engine in memory (vLLM's LoRA support, no adapter files).

vLLM loads adapters named by a ``LoRARequest`` from a directory. The actor's adapter changes after every update, so
:func:`load_adapter_in_memory` runs inside the engine's worker (``LLM.collective_rpc``) and does what vLLM's
``WorkerLoRAManager`` does for a directory, with the tensors given: a ``PEFTHelper`` from the adapter's PEFT config
(checked against the engine's LoRA limits), ``LoRAModel.from_lora_tensors`` with the model's name mapping, then
the adapter replaces the previous one under the same id in the worker's LoRA manager and is activated. Requests
then name it with :func:`lora_request`; its path is never read while the adapter stays loaded (one adapter, one
slot: nothing evicts it). The worker-side names it needs (``model_runner.lora_manager`` and its adapter manager)
are checked by :func:`check_in_memory_loading`, which fails naming ``model.lora.merge`` (merged weights, no LoRA
in the engine) as the way out on a vLLM that lacks them.
"""

from __future__ import annotations

import typing
from typing import Any

import torch

LORA_ID = 1
LORA_NAME = "sead_actor_adapter"
LORA_PATH = "in-memory://sead_actor_adapter"  # never read: the adapter is loaded by load_adapter_in_memory


def max_lora_rank(rank: int) -> int:
    """The engine's ``max_lora_rank`` for an adapter of rank ``rank``: the smallest rank this vLLM allows that holds
    it (vLLM lists them as ``vllm.config.lora.MaxLoRARanks``), or ``rank`` itself where vLLM lists none."""
    try:
        from vllm.config.lora import MaxLoRARanks
    except ImportError:
        return rank
    allowed = sorted(int(r) for r in typing.get_args(MaxLoRARanks))
    fitting = [r for r in allowed if r >= rank]
    if not fitting:
        raise ValueError(f"actor_rollout_ref.model.lora_rank={rank}: this vLLM serves adapters of rank <= "
                         f"{allowed[-1]}; lower it or set actor_rollout_ref.model.lora.merge=true")
    return fitting[0]


def lora_request() -> Any:
    """The ``LoRARequest`` naming the actor's in-memory adapter."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=LORA_NAME, lora_int_id=LORA_ID, lora_path=LORA_PATH)


def _lora_manager(worker: Any) -> Any:
    runner = getattr(worker, "model_runner", None)
    manager = getattr(runner, "lora_manager", None)
    if manager is None or not hasattr(manager, "_adapter_manager"):
        raise RuntimeError("this vLLM's worker has no LoRA manager this rollout can hand an adapter to in memory "
                           "(model_runner.lora_manager); set actor_rollout_ref.model.lora.merge=true to send merged "
                           "weights instead")
    return manager


def check_in_memory_loading(worker: Any) -> bool:
    """Raise unless ``worker`` (a vLLM worker built with ``enable_lora``) can take an adapter in memory."""
    _lora_manager(worker)
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    for owner, name in ((LoRAModel, "from_lora_tensors"), (PEFTHelper, "from_dict")):
        if not hasattr(owner, name):
            raise RuntimeError(f"this vLLM lacks {owner.__name__}.{name}; set actor_rollout_ref.model.lora.merge=true")
    return True


def load_adapter_in_memory(worker: Any, tensors: dict[str, torch.Tensor], config: dict[str, Any], lora_id: int) -> int:
    """Inside a vLLM worker: make ``tensors`` (PEFT's saved names) with PEFT config ``config`` the adapter
    ``lora_id``, replacing the one loaded before; returns how many layers it adapts."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = _lora_manager(worker)
    helper = PEFTHelper.from_dict(dict(config))
    helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    adapter = LoRAModel.from_lora_tensors(
        lora_model_id=lora_id, tensors=tensors, peft_helper=helper, device="cpu",
        dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )  # fmt: skip
    if not adapter.loras:
        raise ValueError(f"the adapter's tensors adapt no layer of the engine's model: {sorted(tensors)[:4]}")
    adapters = manager._adapter_manager
    adapters.remove_adapter(lora_id)
    adapters.add_adapter(adapter)
    adapters.activate_adapter(lora_id)
    return len(adapter.loras)
