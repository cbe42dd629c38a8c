"""Tensor and TensorDict (de)serialisation to plain Python values: (dtype name, shape, raw bytes) per tensor.

veRL's names and layout: a tensor becomes `(dtype, shape, uint8 ndarray)`; a TensorDict becomes
`(batch_size, device, {key: encoded})` where a nested tensor is encoded as `(layout, [encoded component, ...])`.
`verl.protocol` re-exports these functions. `TensorDictIOMixin` gives DataProto its TensorDict conversions and
its pickle files.
"""

from __future__ import annotations

import pickle
from typing import Any, TypeVar

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from verl.errors import ContractError
from verl.protocol_utils import to_row_array
from verl.utils.tensordict_utils import get_tensordict, non_tensor_stack

__all__ = [
    "TensorDictIOMixin", "deserialize_single_tensor", "deserialize_tensordict", "serialize_single_tensor", "serialize_tensordict",
]

Self = TypeVar("Self", bound="TensorDictIOMixin")
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


class TensorDictIOMixin:
    """DataProto's conversions to and from one TensorDict (`to_tensordict`/`from_tensordict`) and its pickle files
    (`save_to_disk`/`load_from_disk`)."""

    batch: TensorDict | None
    non_tensor_batch: dict[str, np.ndarray]
    meta_info: dict[str, Any]

    @classmethod
    def from_tensordict(
        cls: type[Self], tensor_dict: TensorDict, meta_info: dict | None = None, num_batch_dims: int = 1
    ) -> Self:
        """Build from a TensorDict as `to_tensordict` writes it: tensors -> batch, `NonTensorStack`s (one value per
        row) -> non_tensor_batch, `NonTensorData` (one value) -> meta_info (merged over `meta_info`)."""
        if num_batch_dims != 1:
            raise ContractError(
                f"from_tensordict: a DataProto has exactly one batch dim; num_batch_dims={num_batch_dims}"
            )
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
        data = cls.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta)
        if data.batch is None and tensor_dict.batch_size:
            data.batch = TensorDict({}, batch_size=tensor_dict.batch_size[:1])
        return data

    def to_tensordict(self) -> TensorDict:
        """One TensorDict holding everything: tensors as they are, each non-tensor as a `NonTensorStack` (nested
        lists and dicts kept per row), each meta_info value as `NonTensorData` (see `verl.utils.tensordict_utils`)."""
        tensors: dict[str, Any] = {} if self.batch is None else dict(self.batch.items())
        shared = sorted(set(tensors) & set(self.non_tensor_batch))
        if shared:
            raise ContractError(f"to_tensordict: keys {shared} are in both batch and non_tensor_batch")
        tensors.update({key: non_tensor_stack(value) for key, value in self.non_tensor_batch.items()})
        return get_tensordict(tensor_dict=tensors, non_tensor_dict=self.meta_info)

    def save_to_disk(self, filepath: str) -> None:
        """Pickle this DataProto to `filepath`."""
        with open(filepath, "wb") as f:
            pickle.dump(self, f)

    @classmethod
    def load_from_disk(cls: type[Self], filepath: str) -> Self:
        """Load a DataProto written by `save_to_disk` (pickle: only load files you trust)."""
        with open(filepath, "rb") as f:
            data = pickle.load(f)
        if not isinstance(data, cls):
            raise TypeError(f"{filepath} does not hold a {cls.__name__} but a {type(data).__name__}")
        return data
