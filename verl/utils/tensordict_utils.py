"""Building a TensorDict that carries tensors, per-row Python objects and batch-wide values together.

Per-row objects (lists, dicts, strings: anything that is not a tensor) become `NonTensorStack`s of one
`NonTensorData` per row, batch-wide values become `NonTensorData` entries. This is the layout
`DataProto.to_tensordict` produces and `DataProto.from_tensordict` reads (veRL's names).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from verl.errors import ContractError

__all__ = ["get_tensordict", "non_tensor_stack"]


def non_tensor_stack(values: Sequence[Any] | np.ndarray) -> NonTensorStack:
    """One `NonTensorData` per row, stacked, so nested lists/dicts of any length survive as they are."""
    return NonTensorStack.from_list([NonTensorData(value) for value in values])


def get_tensordict(tensor_dict: Mapping[str, Any], non_tensor_dict: Mapping[str, Any] | None = None) -> TensorDict:
    """A TensorDict with one batch dim from `tensor_dict` (tensors, `NonTensorStack`s, or per-row lists/arrays)
    plus `non_tensor_dict` (batch-wide values, stored as `NonTensorData`).

    Every tensor and per-row entry must have the same number of rows.
    """
    rows, first = None, None
    entries: dict[str, Any] = {}
    for key, value in tensor_dict.items():
        if isinstance(value, (torch.Tensor, NonTensorStack)):
            entry = value
        elif isinstance(value, (list, tuple, np.ndarray)):
            entry = non_tensor_stack(value)
        else:
            raise ContractError(
                f"get_tensordict: tensor_dict[{key!r}] is a {type(value).__name__}; expected a tensor or one value per "
                "row (list, tuple, ndarray); put batch-wide values in non_tensor_dict"
            )
        length = len(entry) if not isinstance(entry, torch.Tensor) or not entry.is_nested else entry.size(0)
        if rows is None:
            rows, first = length, key
        elif length != rows:
            raise ContractError(f"get_tensordict: {key!r} has {length} rows but {first!r} has {rows}")
        entries[key] = entry
    output = TensorDict(entries, batch_size=[] if rows is None else [rows])
    for key, value in (non_tensor_dict or {}).items():
        if key in entries:
            raise ContractError(f"get_tensordict: {key!r} is both a per-row entry and a batch-wide value")
        output[key] = NonTensorData(value)
    return output
