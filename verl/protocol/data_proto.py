"""`DataProto`, the batch container passed between the trainer (driver) and the workers, and `DataProtoItem`, one row.

A `DataProto` has three parts, with veRL's names and semantics:

- `batch`: a `tensordict.TensorDict` whose tensors share the leading (row) dimension;
- `non_tensor_batch`: a dict of `np.ndarray` (object dtype allowed), one entry per row, same length as `batch`;
- `meta_info`: a dict of batch-wide values (`temperature`, `do_sample`, `metrics`, ...).

Per-row data (uids, profiles, messages, outcomes) belongs in `batch` or `non_tensor_batch`, never in
`meta_info`: every row operation (select, reorder, repeat, chunk, concat) moves the first two together and
only copies `meta_info` along unchanged, so per-row lists kept there silently fall out of step with the rows.

Contract violations raise `verl.errors.ContractError`, both a ValueError and an AssertionError (veRL's type). The
row arithmetic is in `verl.protocol.rows`, value equality and merging in `verl.protocol.values`, the TensorDict
form in `verl.protocol.serialization`; none of them imports this module.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from verl.errors import ContractError
from verl.protocol.config import DataProtoConfig
from verl.protocol.rows import (
    IndexLike,
    as_index_array,
    chunk_bounds,
    mini_batch_indices,
    padding_index,
    permutation_index,
    repeat_index,
    sample_repeat_index,
    split_bounds,
    unfold_columns,
)
from verl.protocol.serialization import parts_from_tensordict, tensordict_from_parts
from verl.protocol.values import merge_meta_info, to_row_array, union_tensor_dict, values_equal

__all__ = ["DataProto", "DataProtoItem"]


@dataclass(eq=False)
class DataProtoItem:
    """One row of a DataProto: `batch` is a TensorDict without batch dims, `non_tensor_batch` holds the row's values."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False, repr=False)
class DataProto:
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

    # Row layout: reorder, repeat, pad, split and iterate (tensors and non-tensors move together).

    def reorder(self, indices: IndexLike) -> None:
        """Permute the rows in place (tensors and non-tensors alike); `indices` must be a permutation of range(len)."""
        index = permutation_index(indices, len(self))
        if self.batch is not None:
            self.batch = self.batch[torch.from_numpy(index)]
        self.non_tensor_batch = {key: value[index] for key, value in self.non_tensor_batch.items()}

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Repeat every row `repeat_times` times: interleaved (a a b b) or tiled (a b a b)."""
        return self.select_idxs(repeat_index(len(self), repeat_times, interleave))

    def sample_level_repeat(self, repeat_times: Sequence[int] | np.ndarray | torch.Tensor) -> DataProto:
        """Repeat row i `repeat_times[i]` times, keeping copies of a row together (a a a b c c for [3, 1, 2])."""
        return self.select_idxs(sample_repeat_index(repeat_times, len(self)))

    def unfold_column_chunks(self, n_split: int, split_keys: Sequence[str] | None = None) -> DataProto:
        """Cut dim 1 of each `split_keys` entry into `n_split` parts that become consecutive rows; every other entry
        is repeated `n_split` times (row i becomes rows i*n_split .. i*n_split + n_split - 1)."""
        batch, non_tensor_batch = unfold_columns(self.batch, self.non_tensor_batch, n_split, split_keys)
        return type(self)(batch=batch, non_tensor_batch=non_tensor_batch, meta_info=self.meta_info)

    def is_padding_enabled(self) -> bool:
        """True when this DataProto (meta_info flag) or the process (`DataProtoConfig.auto_padding`) allows padding."""
        return bool(self.meta_info.get(DataProtoConfig.auto_padding_key, False)) or DataProtoConfig.auto_padding

    def padding(self, padding_size: int, padding_candidate: str = "") -> None:
        """Append `padding_size` copies of the last row (the first with `padding_candidate="first"`), in place."""
        index = padding_index(len(self), padding_size, padding_candidate)
        if index is not None:
            padded = self.select_idxs(index)
            self.batch, self.non_tensor_batch = padded.batch, padded.non_tensor_batch

    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into `chunks` consecutive parts, each carrying the meta_info.

        The batch size must divide by `chunks`, unless padding is enabled (`is_padding_enabled`): then the first
        `len % chunks` parts get one row more (numpy's array_split).
        """
        bounds = chunk_bounds(len(self), chunks, allow_uneven=self.is_padding_enabled())
        return [self.slice(start, end) for start, end in bounds]

    def split(self, split_size: int) -> list[DataProto]:
        """Split into consecutive parts of `split_size` rows (the last part may be smaller)."""
        return [self.slice(start, end) for start, end in split_bounds(len(self), split_size)]

    def make_iterator(
        self, mini_batch_size: int, epochs: int, seed: int | None = None, dataloader_kwargs: dict | None = None
    ) -> Iterator[DataProto]:
        """Yield mini-batches of `mini_batch_size` rows for `epochs` passes.

        `dataloader_kwargs` go to the torch DataLoader over the row numbers (e.g. `{"shuffle": True}`); `seed`
        seeds its generator, so the shuffled order is reproducible. Each mini-batch carries a copy of meta_info.
        """
        indices = mini_batch_indices(len(self), mini_batch_size, epochs, seed, dataloader_kwargs)
        return (self.select_idxs(index) for index in indices)

    # The TensorDict form and pickle files.

    @classmethod
    def from_tensordict(
        cls, tensor_dict: TensorDict, meta_info: dict | None = None, num_batch_dims: int = 1
    ) -> DataProto:
        """Build from a TensorDict as `to_tensordict` writes it: tensors -> batch, `NonTensorStack`s (one value per
        row) -> non_tensor_batch, `NonTensorData` (one value) -> meta_info (merged over `meta_info`)."""
        if num_batch_dims != 1:
            raise ContractError(
                f"from_tensordict: a DataProto has exactly one batch dim; num_batch_dims={num_batch_dims}"
            )
        tensors, non_tensors, meta = parts_from_tensordict(tensor_dict, meta_info)
        data = cls.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta)
        if data.batch is None and tensor_dict.batch_size:
            data.batch = TensorDict({}, batch_size=tensor_dict.batch_size[:1])
        return data

    def to_tensordict(self) -> TensorDict:
        """One TensorDict holding everything: tensors as they are, each non-tensor as a `NonTensorStack` (nested
        lists and dicts kept per row), each meta_info value as `NonTensorData` (see `verl.utils.tensordict_utils`)."""
        return tensordict_from_parts(self.batch, self.non_tensor_batch, self.meta_info)

    def save_to_disk(self, filepath: str) -> None:
        """Pickle this DataProto to `filepath`."""
        with open(filepath, "wb") as f:
            pickle.dump(self, f)

    @classmethod
    def load_from_disk(cls, filepath: str) -> DataProto:
        """Load a DataProto written by `save_to_disk` (pickle: only load files you trust)."""
        with open(filepath, "rb") as f:
            data = pickle.load(f)
        if not isinstance(data, cls):
            raise TypeError(f"{filepath} does not hold a {cls.__name__} but a {type(data).__name__}")
        return data
