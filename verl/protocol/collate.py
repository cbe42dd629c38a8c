"""`collate_fn`: rows (dicts or `DataProtoItem`s) stacked into one DataProto, e.g. as a DataLoader's collate."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from verl.protocol.data_proto import DataProto, DataProtoItem

__all__ = ["collate_fn"]


def collate_fn(items: Sequence[DataProtoItem | Mapping[str, Any]]) -> DataProto:
    """Stack rows (dicts or DataProtoItems) into a DataProto: tensors are stacked, other values kept per row."""
    if not items:
        raise ValueError("collate_fn: needs at least one row")
    tensors: dict[str, list[torch.Tensor]] = {}
    non_tensors: dict[str, list[Any]] = {}
    for i, item in enumerate(items):
        if isinstance(item, DataProtoItem):
            item = {**({} if item.batch is None else dict(item.batch.items())), **item.non_tensor_batch}
        if not isinstance(item, Mapping):
            raise TypeError(f"collate_fn: row {i} is a {type(item).__name__}, expected a dict or DataProtoItem")
        for key, value in item.items():
            (tensors if isinstance(value, torch.Tensor) else non_tensors).setdefault(key, []).append(value)
    for key, values in {**tensors, **non_tensors}.items():
        if len(values) != len(items):
            raise ValueError(f"collate_fn: key {key!r} is present in {len(values)} of {len(items)} rows")
    stacked = {key: torch.stack(values) for key, values in tensors.items()}
    return DataProto.from_dict(tensors=stacked, non_tensors=non_tensors)
