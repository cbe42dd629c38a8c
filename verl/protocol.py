"""DataProto: the batch container passed between the trainer (driver) and the workers.

A `DataProto` has three parts, with veRL's names and semantics:

- `batch`: a `tensordict.TensorDict` whose tensors share the leading (row) dimension;
- `non_tensor_batch`: a dict of `np.ndarray` (object dtype allowed), one entry per row, same length as `batch`;
- `meta_info`: a dict of batch-wide values (`temperature`, `do_sample`, `metrics`, ...).

Per-row data (uids, profiles, messages, outcomes) belongs in `batch` or `non_tensor_batch`, never in
`meta_info`: every row operation (select, reorder, repeat, chunk, concat) moves the first two together and
only copies `meta_info` along unchanged, so per-row lists kept there silently fall out of step with the rows.

Contract violations raise `verl.errors.ContractError`, both a ValueError and an AssertionError (veRL's type).
The parts live in sibling modules and are re-exported here under their veRL names: DataProto-free helpers
(`union_tensor_dict`, `union_numpy_dict`) in `verl.protocol_utils`, row operations and `DataProtoConfig` in
`verl.protocol_rows`, padding/folding functions in `verl.protocol_ops`, tensor (de)serialisation in
`verl.protocol_serialization`, and `DataProtoFuture` in `verl.protocol_future`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from verl.errors import ContractError
from verl.protocol_future import DataProtoFuture
from verl.protocol_ops import (
    DP_PAD_ROWS_KEY,
    fold_batch_dim,
    pad_dataproto_to_divisor,
    unfold_batch_dim,
    unpad_dataproto,
)
from verl.protocol_rows import DataProtoConfig, RowOpsMixin
from verl.protocol_serialization import (
    TensorDictIOMixin,
    deserialize_single_tensor,
    deserialize_tensordict,
    serialize_single_tensor,
    serialize_tensordict,
)
from verl.protocol_utils import (
    IndexLike,
    as_index_array,
    merge_meta_info,
    to_row_array,
    union_numpy_dict,
    union_tensor_dict,
    values_equal,
)

__all__ = [
    "DP_PAD_ROWS_KEY", "DataProto", "DataProtoConfig", "DataProtoFuture", "DataProtoItem", "collate_fn",
    "deserialize_single_tensor", "deserialize_tensordict", "fold_batch_dim", "pad_dataproto_to_divisor",
    "serialize_single_tensor", "serialize_tensordict", "unfold_batch_dim", "union_numpy_dict", "union_tensor_dict",
    "unpad_dataproto",
]  # fmt: skip


@dataclass(eq=False)
class DataProtoItem:
    """One row of a DataProto: `batch` is a TensorDict without batch dims, `non_tensor_batch` holds the row's values."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False, repr=False)
class DataProto(RowOpsMixin, TensorDictIOMixin):
    """A batch of rows: tensors (`batch`), per-row numpy arrays (`non_tensor_batch`) and batch-wide `meta_info`.

    Equality is identity (comparing tensors/arrays has no single truth value); `repr` is a one-line summary.
    """

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.non_tensor_batch = {} if self.non_tensor_batch is None else dict(self.non_tensor_batch)
        self.meta_info = {} if self.meta_info is None else self.meta_info
        self.check_consistency()

    def check_consistency(self) -> None:
        """Raise unless `batch` is a TensorDict with one batch dim and each non-tensor an ndarray of the batch length."""
        length = None
        if self.batch is not None:
            if not isinstance(self.batch, TensorDict):
                raise TypeError(f"DataProto.batch must be a TensorDict or None, got {type(self.batch).__name__}")
            if len(self.batch.batch_size) != 1:
                raise ContractError(
                    f"DataProto.batch must have exactly one batch dim (the rows), got {tuple(self.batch.batch_size)}; "
                    "use fold_batch_dim to group rows"
                )
            length = self.batch.batch_size[0]
        if not isinstance(self.meta_info, dict):
            raise TypeError(f"DataProto.meta_info must be a dict, got {type(self.meta_info).__name__}")
        for key, value in self.non_tensor_batch.items():
            if not isinstance(value, np.ndarray):
                raise TypeError(f"non_tensor_batch[{key!r}] must be an np.ndarray, got {type(value).__name__}")
            if value.ndim == 0:
                raise ContractError(f"non_tensor_batch[{key!r}] is a 0-d array; it needs one entry per row")
            if length is None:
                length = value.shape[0]
            elif value.shape[0] != length:
                raise ContractError(
                    f"non_tensor_batch[{key!r}] has length {value.shape[0]}, but the batch size is {length}"
                )

    @classmethod
    def from_single_dict(
        cls, data: Mapping[str, Any], meta_info: dict | None = None, auto_padding: bool = False
    ) -> DataProto:
        """Build from one dict, sorting values into tensors (-> batch) and ndarrays (-> non_tensor_batch)."""
        tensors, non_tensors = {}, {}
        for key, value in data.items():
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            elif isinstance(value, np.ndarray):
                non_tensors[key] = value
            else:
                raise TypeError(f"from_single_dict: key {key!r} has unsupported type {type(value).__name__}")
        return cls.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info, auto_padding=auto_padding)

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta_info: dict | None = None,
        num_batch_dims: int = 1,
        auto_padding: bool = False,
    ) -> DataProto:
        """Build from tensors sharing their first dim (the rows), per-row arrays and meta_info.

        A list or tuple in `non_tensors` becomes a 1-D object array with one element per row. `num_batch_dims`
        (veRL's argument) must be 1: a DataProto has exactly one batch dim. `auto_padding=True` lets `chunk`
        split this DataProto unevenly (see `DataProtoConfig`).
        """
        if num_batch_dims != 1:
            raise ContractError(f"from_dict: a DataProto has exactly one batch dim; num_batch_dims={num_batch_dims}")
        tensors = dict(tensors or {})
        non_tensors = {key: to_row_array(value, key) for key, value in (non_tensors or {}).items()}
        batch = None
        if tensors:
            batch_size, first_key = None, None
            for key, tensor in tensors.items():
                if not isinstance(tensor, torch.Tensor):
                    raise TypeError(f"from_dict: tensors[{key!r}] is a {type(tensor).__name__}, not a torch.Tensor")
                shape = tuple(tensor.shape[:num_batch_dims])
                if len(shape) < num_batch_dims:
                    raise ContractError(
                        f"from_dict: tensors[{key!r}] has {tensor.dim()} dims < num_batch_dims={num_batch_dims}"
                    )
                if batch_size is None:
                    batch_size, first_key = shape, key
                elif shape != batch_size:
                    raise ContractError(
                        f"from_dict: tensors[{key!r}] has batch shape {shape}, "
                        f"but tensors[{first_key!r}] has {batch_size}"
                    )
            batch = TensorDict(tensors, batch_size=batch_size)
        meta_info = dict(meta_info or {})
        if auto_padding:
            meta_info[DataProtoConfig.auto_padding_key] = True
        return cls(batch=batch, non_tensor_batch=non_tensors, meta_info=meta_info)

    def __len__(self) -> int:
        if self.batch is not None:
            return self.batch.batch_size[0]
        if self.non_tensor_batch:
            return next(iter(self.non_tensor_batch.values())).shape[0]
        return 0

    def __repr__(self) -> str:
        batch_keys = [] if self.batch is None else list(self.batch.keys())
        return (
            f"DataProto(rows={len(self)}, batch={batch_keys}, non_tensor_batch={list(self.non_tensor_batch)}, "
            f"meta_info={list(self.meta_info)})"
        )

    def _has_rows(self) -> bool:
        """True when this DataProto carries row data (a tensor batch or non-tensor arrays), even zero rows."""
        return self.batch is not None or bool(self.non_tensor_batch)

    def __getitem__(self, item: int | slice | IndexLike) -> DataProtoItem | DataProto:
        """An int gives a DataProtoItem, a slice gives `slice()`, a list/ndarray/tensor gives `select_idxs()`."""
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, (int, np.integer)) or (isinstance(item, torch.Tensor) and item.dim() == 0):
            index = int(item)
            length = len(self)
            if not -length <= index < length:
                raise IndexError(f"row {index} out of range for a batch of {length} rows")
            return DataProtoItem(
                batch=None if self.batch is None else self.batch[index],
                non_tensor_batch={key: value[index] for key, value in self.non_tensor_batch.items()},
                meta_info=self.meta_info,
            )
        if isinstance(item, (list, tuple, np.ndarray, torch.Tensor)):
            return self.select_idxs(item)
        raise TypeError(f"DataProto indices must be int, slice, list, ndarray or tensor, got {type(item).__name__}")

    def get_data_info(self) -> str:
        """Return a readable summary: row count, each tensor's shape/dtype, each non-tensor's dtype, meta_info keys."""
        lines = [f"DataProto with {len(self)} rows"]
        if self.batch is not None:
            lines += [f"  batch[{k!r}]: {tuple(v.shape)} {v.dtype}" for k, v in self.batch.items()]
        lines += [f"  non_tensor_batch[{k!r}]: {v.shape} {v.dtype}" for k, v in self.non_tensor_batch.items()]
        lines.append(f"  meta_info keys: {sorted(self.meta_info)}")
        return "\n".join(lines)

    def to(self, device: str | torch.device) -> DataProto:
        """Move the tensors to `device` (in place) and return self."""
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def select(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """Return a DataProto with only the given keys of each part (None keeps all of that part)."""
        batch = None if self.batch is None else self.batch.copy()
        if batch_keys is not None:
            available = [] if self.batch is None else list(self.batch.keys())
            missing = [key for key in batch_keys if key not in available]
            if missing:
                raise KeyError(f"select: batch keys {missing} not found; available: {available}")
            batch = None if self.batch is None else self.batch.select(*batch_keys)
        non_tensor_batch = self._pick(self.non_tensor_batch, non_tensor_batch_keys, "non_tensor_batch")
        meta_info = self._pick(self.meta_info, meta_info_keys, "meta_info")
        if deepcopy:
            batch = None if batch is None else batch.clone()
            non_tensor_batch, meta_info = copy.deepcopy(non_tensor_batch), copy.deepcopy(meta_info)
        return type(self)(batch=batch, non_tensor_batch=non_tensor_batch, meta_info=meta_info)

    @staticmethod
    def _pick(source: dict, keys: Sequence[str] | None, part: str) -> dict:
        """Return the sub-dict of `source` with `keys` (all when None); a missing key raises KeyError naming it."""
        if keys is None:
            return dict(source)
        missing = [key for key in keys if key not in source]
        if missing:
            raise KeyError(f"{part} keys {missing} not found; available: {list(source)}")
        return {key: source[key] for key in keys}

    def pop(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
    ) -> DataProto:
        """Remove the given keys from self and return them as a new DataProto (None pops nothing from that part)."""
        picked = self.select(batch_keys or [], non_tensor_batch_keys or [], meta_info_keys or [])
        for key in batch_keys or []:
            self.batch.pop(key)
        for key in non_tensor_batch_keys or []:
            self.non_tensor_batch.pop(key)
        for key in meta_info_keys or []:
            self.meta_info.pop(key)
        return picked

    def rename(
        self, old_keys: str | Sequence[str] | None = None, new_keys: str | Sequence[str] | None = None
    ) -> DataProto:
        """Rename batch keys in place (`old_keys[i]` -> `new_keys[i]`) and return self."""
        old_keys = [old_keys] if isinstance(old_keys, str) else list(old_keys or [])
        new_keys = [new_keys] if isinstance(new_keys, str) else list(new_keys or [])
        if len(old_keys) != len(new_keys):
            raise ValueError(f"rename: {len(old_keys)} old keys but {len(new_keys)} new keys")
        available = [] if self.batch is None else list(self.batch.keys())
        for old, new in zip(old_keys, new_keys):
            if old not in available:
                raise KeyError(f"rename: batch key {old!r} not found; available: {available}")
            self.batch.rename_key_(old, new)
        return self

    def union(self, other: DataProto) -> DataProto:
        """Merge `other` into self (in place) and return self; keys present in both must hold equal values."""
        if self._has_rows() and other._has_rows() and len(self) != len(other):
            raise ContractError(f"union: batch sizes differ: {len(self)} vs {len(other)}")
        if other.batch is not None:
            self.batch = other.batch.copy() if self.batch is None else union_tensor_dict(self.batch, other.batch)
        for key, value in other.non_tensor_batch.items():
            if key in self.non_tensor_batch and not values_equal(self.non_tensor_batch[key], value):
                raise ContractError(f"union: non_tensor_batch key {key!r} is in both batches with different values")
            self.non_tensor_batch[key] = value
        merge_meta_info(self.meta_info, other.meta_info, "union")
        self.check_consistency()
        return self

    def select_idxs(self, idxs: IndexLike) -> DataProto:
        """Return the rows at `idxs` (ints, negative allowed, or a boolean mask of the batch length), in that order."""
        index = as_index_array(idxs, len(self))
        batch = None if self.batch is None else self.batch[torch.from_numpy(index)]
        non_tensor_batch = {key: value[index] for key, value in self.non_tensor_batch.items()}
        return type(self)(batch=batch, non_tensor_batch=non_tensor_batch, meta_info=dict(self.meta_info))

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProto:
        """Return rows `start:end:step` (Python slice semantics; tensors are views)."""
        rows = slice(start, end, step)
        batch = None if self.batch is None else self.batch[rows]
        non_tensor_batch = {key: value[rows] for key, value in self.non_tensor_batch.items()}
        return type(self)(batch=batch, non_tensor_batch=non_tensor_batch, meta_info=dict(self.meta_info))

    @staticmethod
    def concat(data: Sequence[DataProto]) -> DataProto:
        """Concatenate along rows (all parts need the same keys); merge meta_info, gathering `metrics` into lists.

        A meta_info key other than `metrics` must hold equal values in every part. `metrics` may be a dict or a
        list of dicts per part; the result maps each name to the list of all values (list values are extended).
        """
        if not data:
            raise ContractError("concat: needs at least one DataProto")
        has_batch = [d.batch is not None for d in data]
        if any(has_batch) and not all(has_batch):
            raise ContractError("concat: some parts have a tensor batch and some do not")
        batch_keys = set(data[0].batch.keys()) if all(has_batch) else set()
        keys = set(data[0].non_tensor_batch)
        for i, d in enumerate(data):
            if d.batch is not None and set(d.batch.keys()) != batch_keys:
                raise ContractError(
                    f"concat: part {i} has batch keys {sorted(d.batch.keys())}, part 0 has {sorted(batch_keys)}"
                )
            if set(d.non_tensor_batch) != keys:
                raise ContractError(
                    f"concat: part {i} has non_tensor_batch keys {sorted(d.non_tensor_batch)}, "
                    f"part 0 has {sorted(keys)}"
                )
        batch = torch.cat([d.batch for d in data], dim=0) if all(has_batch) else None
        non_tensor_batch = {key: np.concatenate([d.non_tensor_batch[key] for d in data], axis=0) for key in keys}
        meta_info: dict[str, Any] = {}
        gathered: dict[str, list] = {}
        for d in data:
            for key, value in d.meta_info.items():
                if key == "metrics":
                    for metrics in value if isinstance(value, list) else [value or {}]:
                        for name, metric in metrics.items():
                            gathered.setdefault(name, []).extend(metric if isinstance(metric, list) else [metric])
                else:
                    merge_meta_info(meta_info, {key: value}, "concat")
        if gathered:
            meta_info["metrics"] = gathered
        return type(data[0])(batch=batch, non_tensor_batch=non_tensor_batch, meta_info=meta_info)

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
