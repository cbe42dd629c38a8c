"""Deep value equality and the merges built on it: meta_info dicts, TensorDicts and dicts of per-row arrays.

These helpers know nothing of `DataProto`; `union_tensor_dict` and `union_numpy_dict` are re-exported from
`verl.protocol` (their veRL home). Contract violations raise `ContractError` (a ValueError and an AssertionError).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from verl.errors import ContractError

__all__ = ["merge_meta_info", "to_row_array", "union_numpy_dict", "union_tensor_dict", "values_equal"]


def values_equal(a: Any, b: Any, _in_progress: set[tuple[int, int]] | None = None) -> bool:
    """Return True when two values (scalars, arrays, tensors, containers) hold equal contents; NaN equals NaN.

    Object arrays and containers are compared element by element; self-referencing structures are handled (a
    pair already under comparison counts as equal, so two structurally identical cycles are equal).
    """
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
            return False
        if torch.equal(a, b):
            return True
        return bool(a.is_floating_point() and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    is_container = isinstance(a, (np.ndarray, Mapping, list, tuple))
    if not is_container:
        if isinstance(b, np.ndarray):
            return False
        try:
            return bool(a == b)
        except (TypeError, ValueError):
            return False
    in_progress = set() if _in_progress is None else _in_progress
    pair = (id(a), id(b))
    if pair in in_progress:
        return True
    in_progress.add(pair)
    try:
        return _containers_equal(a, b, in_progress)
    finally:
        in_progress.discard(pair)


def _containers_equal(a: Any, b: Any, in_progress: set[tuple[int, int]]) -> bool:
    """Element-wise equality of two arrays, mappings or sequences (the recursive part of `values_equal`)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.shape != b.shape:
            return False
        if a.dtype == object or b.dtype == object:
            return all(values_equal(x, y, in_progress) for x, y in zip(a.ravel(), b.ravel()))
        return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc" and b.dtype.kind in "fc"))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(values_equal(a[k], b[k], in_progress) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return (
            type(a) is type(b) and len(a) == len(b) and all(values_equal(x, y, in_progress) for x, y in zip(a, b))
        )
    return False


def merge_meta_info(target: dict, source: Mapping, where: str) -> dict:
    """Copy `source` into `target`; a key present in both must hold equal values."""
    for key, value in source.items():
        if key in target and not values_equal(target[key], value):
            raise ContractError(f"{where}: Conflicting values for meta_info key {key!r}: {target[key]!r} != {value!r}")
        target[key] = value
    return target


def to_row_array(values: Any, key: str) -> np.ndarray:
    """Return `values` as a per-row ndarray; lists/tuples become 1-D object arrays (one element per row)."""
    if isinstance(values, np.ndarray):
        return values
    if isinstance(values, (list, tuple)):
        array = np.empty(len(values), dtype=object)
        for i, value in enumerate(values):
            array[i] = value
        return array
    raise TypeError(f"non_tensor_batch[{key!r}] must be an np.ndarray (or a list), got {type(values).__name__}")


def union_tensor_dict(tensor_dict1: TensorDict, tensor_dict2: TensorDict) -> TensorDict:
    """Add the keys of `tensor_dict2` to `tensor_dict1` in place and return it; shared keys must hold equal tensors."""
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise ContractError(
            "union_tensor_dict: batch sizes differ: "
            f"{tuple(tensor_dict1.batch_size)} vs {tuple(tensor_dict2.batch_size)}"
        )
    for key in tensor_dict2.keys():
        if key in tensor_dict1.keys() and not values_equal(tensor_dict1[key], tensor_dict2[key]):
            raise ContractError(f"union_tensor_dict: key {key!r} is in both batches with different values")
        tensor_dict1[key] = tensor_dict2[key]
    return tensor_dict1


def union_numpy_dict(tensor_dict1: dict[str, np.ndarray], tensor_dict2: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Add the arrays of `tensor_dict2` to `tensor_dict1` in place and return it; shared keys must hold equal arrays.

    Equality is deep (object arrays element by element, NaN equal to NaN at the same position).
    """
    for key, value in tensor_dict2.items():
        if key in tensor_dict1:
            if not (isinstance(value, np.ndarray) and isinstance(tensor_dict1[key], np.ndarray)):
                raise ContractError(f"union_numpy_dict: `{key}` must be an np.ndarray in both dicts")
            if not values_equal(tensor_dict1[key], value):
                raise ContractError(f"`{key}` in tensor_dict1 and tensor_dict2 are not the same object.")
        tensor_dict1[key] = value
    return tensor_dict1
