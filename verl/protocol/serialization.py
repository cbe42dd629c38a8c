"""Tensor and TensorDict (de)serialisation to plain Python values: (dtype name, shape, raw bytes) per tensor.

veRL's names and layout: a tensor becomes `(dtype, shape, uint8 ndarray)`; a TensorDict becomes
`(batch_size, device, {key: encoded})` where a nested tensor is encoded as `(layout, [encoded component, ...])`.
`verl.protocol` re-exports these functions. `tensordict_from_parts` / `parts_from_tensordict` are the one-TensorDict
form of a DataProto's three parts (`DataProto.to_tensordict` / `from_tensordict`). Nothing here knows `DataProto`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from verl.errors import ContractError
from verl.protocol.values import to_row_array
from verl.utils.tensordict_utils import get_tensordict, non_tensor_stack

__all__ = [
    "deserialize_single_tensor", "deserialize_tensordict", "parts_from_tensordict", "serialize_single_tensor",
    "serialize_tensordict", "tensordict_from_parts",
]  # fmt: skip

EncodedTensor = tuple[str, tuple[int, ...], np.ndarray]


def serialize_single_tensor(obj: torch.Tensor) -> EncodedTensor:
    """`(dtype name without "torch.", shape, its bytes as a uint8 ndarray)`; the tensor is copied to the CPU."""
    data = obj.detach().cpu().flatten().contiguous().view(torch.uint8).numpy()
    return str(obj.dtype).removeprefix("torch."), tuple(obj.shape), data


def deserialize_single_tensor(arr: EncodedTensor | tuple[str, Any, Any]) -> torch.Tensor:
    """Rebuild a tensor from `serialize_single_tensor`'s triple (a writable copy of the bytes)."""
    dtype_name, shape, data = arr
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ContractError(f"deserialize_single_tensor: {dtype_name!r} is not a torch dtype")
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    return raw.view(dtype).view(tuple(shape))


def serialize_tensordict(batch: TensorDict) -> tuple[tuple[int, ...], str | None, dict[str, tuple]]:
    """`(batch_size, device or None, {key: encoded tensor or (layout, [encoded components])})`."""
    encoded: dict[str, tuple] = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):
            raise ContractError(f"serialize_tensordict: {key!r} is a {type(value).__name__}, not a tensor")
        if value.is_nested:
            layout = str(value.layout).removeprefix("torch.")
            encoded[key] = (layout, [serialize_single_tensor(part) for part in value.unbind()])
        else:
            encoded[key] = serialize_single_tensor(value)
    device = None if batch.device is None else str(batch.device)
    return tuple(batch.batch_size), device, encoded


def deserialize_tensordict(arr: tuple[Any, Any, dict[str, tuple]]) -> TensorDict:
    """Rebuild a TensorDict from `serialize_tensordict`'s triple."""
    batch_size, device, encoded = arr
    decoded: dict[str, torch.Tensor] = {}
    for key, value in encoded.items():
        if len(value) == 3:
            decoded[key] = deserialize_single_tensor(value)
        elif len(value) == 2:
            layout_name, parts = value
            layout = getattr(torch, layout_name, None)
            if not isinstance(layout, torch.layout):
                raise ContractError(f"deserialize_tensordict: {key!r} has unknown layout {layout_name!r}")
            decoded[key] = torch.nested.as_nested_tensor([deserialize_single_tensor(p) for p in parts], layout=layout)
        else:
            raise ContractError(
                f"deserialize_tensordict: {key!r} has an encoding of length {len(value)}; expected 3 (tensor) or 2 "
                "(nested tensor)"
            )
    return TensorDict(decoded, batch_size=batch_size, device=device)


def tensordict_from_parts(
    batch: TensorDict | None, non_tensor_batch: dict[str, np.ndarray], meta_info: dict[str, Any]
) -> TensorDict:
    """One TensorDict holding a DataProto's three parts: tensors as they are, each non-tensor as a `NonTensorStack`
    (nested lists and dicts kept per row), each meta_info value as `NonTensorData` (`DataProto.to_tensordict`)."""
    tensors: dict[str, Any] = {} if batch is None else dict(batch.items())
    shared = sorted(set(tensors) & set(non_tensor_batch))
    if shared:
        raise ContractError(f"to_tensordict: keys {shared} are in both batch and non_tensor_batch")
    tensors.update({key: non_tensor_stack(value) for key, value in non_tensor_batch.items()})
    return get_tensordict(tensor_dict=tensors, non_tensor_dict=meta_info)


def parts_from_tensordict(
    tensor_dict: TensorDict, meta_info: dict | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray], dict[str, Any]]:
    """(tensors, per-row arrays, meta_info) of a TensorDict as `tensordict_from_parts` writes it: tensors -> tensors,
    `NonTensorStack`s (one value per row) -> arrays, `NonTensorData` (one value) -> meta_info, merged over
    `meta_info` (`DataProto.from_tensordict`)."""
    tensors, non_tensors, meta = {}, {}, dict(meta_info or {})
    for key, value in tensor_dict.items():
        if isinstance(value, NonTensorStack):
            non_tensors[key] = to_row_array([item.data if isinstance(item, NonTensorData) else item
                                             for item in value], key)
        elif isinstance(value, NonTensorData):
            meta[key] = value.data
        elif isinstance(value, torch.Tensor):
            tensors[key] = value
        else:
            raise TypeError(f"from_tensordict: {key!r} holds a {type(value).__name__}; expected a tensor or "
                            "NonTensorStack/NonTensorData")
    return tensors, non_tensors, meta
