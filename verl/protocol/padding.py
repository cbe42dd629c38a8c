"""Module-level DataProto operations with veRL's names: padding to a divisor and back, folding the batch dim.

They build on DataProto's own methods (`select_idxs`, `slice`) and constructor; `verl.protocol` re-exports them.
"""

from __future__ import annotations

import numpy as np

from verl.errors import ContractError
from verl.protocol.data_proto import DataProto

__all__ = ["DP_PAD_ROWS_KEY", "fold_batch_dim", "pad_dataproto_to_divisor", "unfold_batch_dim", "unpad_dataproto"]

DP_PAD_ROWS_KEY = "dp_pad_rows"
"""meta_info key set by the `DP_COMPUTE_PROTO` dispatch on a chunk that ends with padding rows: how many."""


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad `data` to a multiple of `size_divisor` rows by repeating its leading rows; return (padded, pad_size)."""
    if size_divisor < 1:
        raise ContractError(f"pad_dataproto_to_divisor: size_divisor must be >= 1, got {size_divisor}")
    length = len(data)
    pad_size = (size_divisor - length % size_divisor) % size_divisor
    if pad_size == 0:
        return data, 0
    if length == 0:
        raise ContractError("pad_dataproto_to_divisor: cannot pad an empty DataProto")
    return data.select_idxs(np.arange(length + pad_size) % length), pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last `pad_size` rows added by `pad_dataproto_to_divisor`."""
    if not 0 <= pad_size <= len(data):
        raise ContractError(f"unpad_dataproto: pad_size {pad_size} is outside [0, {len(data)}]")
    return data if pad_size == 0 else data.slice(0, len(data) - pad_size)


def fold_batch_dim(data: DataProto, new_batch_size: int) -> DataProto:
    """Group consecutive rows: [bs, ...] becomes [new_batch_size, bs // new_batch_size, ...] (tensors and arrays).

    The result still has one batch dim (`new_batch_size` rows, each holding a block of the old rows).
    """
    length = len(data)
    if new_batch_size < 1 or length % new_batch_size != 0:
        raise ContractError(f"fold_batch_dim: {length} rows do not fold into new_batch_size={new_batch_size}")
    batch = None
    if data.batch is not None:
        batch = data.batch.view(new_batch_size, -1)
        batch.auto_batch_size_(batch_dims=1)
    non_tensor_batch = {
        key: np.reshape(value, (new_batch_size, -1, *value.shape[1:])) for key, value in data.non_tensor_batch.items()
    }
    return type(data)(batch=batch, non_tensor_batch=non_tensor_batch, meta_info=data.meta_info)


def unfold_batch_dim(data: DataProto, batch_dims: int = 2) -> DataProto:
    """Undo `fold_batch_dim`: flatten the first `batch_dims` dims of every tensor and array into the rows."""
    if batch_dims < 1:
        raise ContractError(f"unfold_batch_dim: batch_dims must be >= 1, got {batch_dims}")
    batch = None
    rows = None
    if data.batch is not None:
        batch = data.batch.clone(recurse=False)
        batch.auto_batch_size_(batch_dims=batch_dims)
        batch = batch.view(-1)
        rows = batch.batch_size[0]
    non_tensor_batch = {}
    for key, value in data.non_tensor_batch.items():
        flat_rows = int(np.prod(value.shape[:batch_dims])) if rows is None else rows
        non_tensor_batch[key] = np.reshape(value, (flat_rows, *value.shape[batch_dims:]))
    return type(data)(batch=batch, non_tensor_batch=non_tensor_batch, meta_info=data.meta_info)
