"""Row-layout operations of `DataProto` (reorder, repeat, chunk, split, padding, column unfolding, mini-batch
iteration) and
`DataProtoConfig`, the process-wide auto-padding switch.

`DataProto` inherits `RowOpsMixin`; the mixin only uses `select_idxs`, `slice`, `concat` and the three parts of a
DataProto, so this module does not import `verl.protocol`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
from tensordict import TensorDict
from torch.utils.data import DataLoader

from verl.errors import ContractError
from verl.protocol_utils import IndexLike, as_index_array, rows_to_index

__all__ = ["DataProtoConfig", "RowOpsMixin"]

Self = TypeVar("Self", bound="RowOpsMixin")


class _DataProtoConfigMeta(type):
    """Metaclass giving `DataProtoConfig.auto_padding` a class-level getter (env default) and a checked setter."""

    _auto_padding: bool | None = None

    @property
    def auto_padding(cls) -> bool:
        """True when set so, or (never set) when the environment variable VERL_AUTO_PADDING is "1" or "true"."""
        if cls._auto_padding is not None:
            return cls._auto_padding
        return os.environ.get("VERL_AUTO_PADDING", "").strip().lower() in ("1", "true")

    @auto_padding.setter
    def auto_padding(cls, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise ContractError(f"DataProtoConfig.auto_padding must be a bool, got {enabled!r}")
        cls._auto_padding = enabled


class DataProtoConfig(metaclass=_DataProtoConfigMeta):
    """Process-wide DataProto settings (veRL's names).

    `DataProtoConfig.auto_padding = True` (or VERL_AUTO_PADDING=1) lets `chunk` split a batch that does not divide
    evenly; a single DataProto opts in with `from_dict(..., auto_padding=True)`, which sets
    `meta_info[auto_padding_key]`. The `DP_COMPUTE_PROTO` dispatch pads to the world size in any case.
    """

    auto_padding_key = "_verl_auto_padding"


class RowOpsMixin:
    """Operations that rearrange, repeat or split the rows of a DataProto (tensors and non-tensors together)."""

    batch: TensorDict | None
    non_tensor_batch: dict[str, np.ndarray]
    meta_info: dict[str, Any]

    def _same_kind(self: Self, batch: TensorDict | None, non_tensor_batch: dict[str, np.ndarray]) -> Self:
        """A new object of this class with the given rows and this one's meta_info."""
        return type(self)(batch=batch, non_tensor_batch=non_tensor_batch, meta_info=self.meta_info)

    def reorder(self, indices: IndexLike) -> None:
        """Permute the rows in place (tensors and non-tensors alike); `indices` must be a permutation of range(len)."""
        index = as_index_array(indices, len(self))
        if not np.array_equal(np.sort(index), np.arange(len(self))):
            raise ContractError(
                f"reorder: indices must be a permutation of range({len(self)}); got {len(index)} indices, "
                f"{len(np.unique(index))} distinct"
            )
        if self.batch is not None:
            self.batch = self.batch[torch.from_numpy(index)]
        self.non_tensor_batch = {key: value[index] for key, value in self.non_tensor_batch.items()}

    def repeat(self: Self, repeat_times: int = 2, interleave: bool = True) -> Self:
        """Repeat every row `repeat_times` times: interleaved (a a b b) or tiled (a b a b)."""
        if repeat_times < 1:
            raise ContractError(f"repeat: repeat_times must be >= 1, got {repeat_times}")
        rows = np.arange(len(self))
        index = np.repeat(rows, repeat_times) if interleave else np.tile(rows, repeat_times)
        return self.select_idxs(index)

    def sample_level_repeat(self: Self, repeat_times: Sequence[int] | np.ndarray | torch.Tensor) -> Self:
        """Repeat row i `repeat_times[i]` times, keeping copies of a row together (a a a b c c for [3, 1, 2])."""
        counts = repeat_times.detach().cpu().numpy() if isinstance(repeat_times, torch.Tensor) else repeat_times
        counts = np.asarray(list(counts) if isinstance(counts, tuple) else counts)
        if counts.ndim != 1 or len(counts) != len(self):
            raise ContractError(
                f"sample_level_repeat: repeat_times must be 1-D with one count per row ({len(self)}), "
                f"got shape {counts.shape}"
            )
        if counts.size and (not np.issubdtype(counts.dtype, np.integer) or counts.min() < 0):
            raise ContractError(f"sample_level_repeat: repeat_times must be non-negative ints, got {counts.tolist()}")
        return self.select_idxs(np.repeat(np.arange(len(self)), counts.astype(np.int64)))

    def unfold_column_chunks(self: Self, n_split: int, split_keys: Sequence[str] | None = None) -> Self:
        """Cut dim 1 of each `split_keys` entry into `n_split` parts that become consecutive rows; every other entry
        is repeated `n_split` times (row i becomes rows i*n_split .. i*n_split + n_split - 1)."""
        split = set(split_keys or ())
        parts = {**({} if self.batch is None else dict(self.batch.items())), **self.non_tensor_batch}
        for key in split:
            if key not in parts:
                raise ContractError(f"unfold_column_chunks: split key {key!r} not found; available: {sorted(parts)}")
            if parts[key].ndim < 2 or parts[key].shape[1] % n_split != 0:
                raise ContractError(
                    f"unfold_column_chunks: {key!r} has shape {tuple(parts[key].shape)}; dim 1 must divide by {n_split}"
                )

        def unfold(key: str, value: Any) -> Any:
            if key in split:
                return value.reshape(value.shape[0] * n_split, value.shape[1] // n_split, *value.shape[2:])
            if isinstance(value, torch.Tensor):
                return torch.repeat_interleave(value, n_split, dim=0)
            return np.repeat(value, n_split, axis=0)

        batch = None
        if self.batch is not None:
            tensors = {key: unfold(key, value) for key, value in self.batch.items()}
            batch = TensorDict(tensors, batch_size=[len(self) * n_split], device=self.batch.device)
        non_tensor_batch = {key: unfold(key, value) for key, value in self.non_tensor_batch.items()}
        return self._same_kind(batch, non_tensor_batch)

    def is_padding_enabled(self) -> bool:
        """True when this DataProto (meta_info flag) or the process (`DataProtoConfig.auto_padding`) allows padding."""
        return bool(self.meta_info.get(DataProtoConfig.auto_padding_key, False)) or DataProtoConfig.auto_padding

    def padding(self, padding_size: int, padding_candidate: str = "") -> None:
        """Append `padding_size` copies of the last row (the first with `padding_candidate="first"`), in place."""
        if padding_size < 0:
            raise ContractError(f"padding: padding_size must be >= 0, got {padding_size}")
        if padding_size == 0:
            return
        if len(self) == 0:
            raise ContractError("padding: cannot pad an empty DataProto")
        source = 0 if padding_candidate == "first" else len(self) - 1
        padded = self.select_idxs(np.concatenate([np.arange(len(self)), np.full(padding_size, source)]))
        self.batch, self.non_tensor_batch = padded.batch, padded.non_tensor_batch

    def chunk(self: Self, chunks: int) -> list[Self]:
        """Split into `chunks` consecutive parts, each carrying the meta_info.

        The batch size must divide by `chunks`, unless padding is enabled (`is_padding_enabled`): then the first
        `len % chunks` parts get one row more (numpy's array_split).
        """
        if chunks < 1:
            raise ContractError(f"chunk: chunks must be >= 1, got {chunks}")
        if len(self) % chunks != 0 and not self.is_padding_enabled():
            raise ContractError(
                f"chunk: only equal chunks are supported; batch size {len(self)} is not divisible by chunks={chunks} "
                "(pad first with pad_dataproto_to_divisor, or enable auto_padding)"
            )
        bounds = np.cumsum([0] + [len(part) for part in np.array_split(np.arange(len(self)), chunks)])
        return [self.slice(int(bounds[i]), int(bounds[i + 1])) for i in range(chunks)]

    def split(self: Self, split_size: int) -> list[Self]:
        """Split into consecutive parts of `split_size` rows (the last part may be smaller)."""
        if split_size < 1:
            raise ContractError(f"split: split_size must be >= 1, got {split_size}")
        return [self.slice(i, i + split_size) for i in range(0, len(self), split_size)]

    def make_iterator(
        self: Self, mini_batch_size: int, epochs: int, seed: int | None = None, dataloader_kwargs: dict | None = None
    ) -> Iterator[Self]:
        """Yield mini-batches of `mini_batch_size` rows for `epochs` passes.

        `dataloader_kwargs` go to the torch DataLoader over the row numbers (e.g. `{"shuffle": True}`); `seed`
        seeds its generator, so the shuffled order is reproducible. Each mini-batch carries a copy of meta_info.
        """
        if mini_batch_size < 1 or len(self) % mini_batch_size != 0:
            raise ContractError(
                f"make_iterator: batch size {len(self)} is not divisible by mini_batch_size={mini_batch_size}"
            )
        generator = None
        if seed is not None:
            generator = torch.Generator()
            generator.manual_seed(seed)
        loader = DataLoader(
            range(len(self)),
            batch_size=mini_batch_size,
            collate_fn=rows_to_index,
            generator=generator,
            **(dataloader_kwargs or {}),
        )

        def iterate() -> Iterator[Self]:
            for _ in range(epochs):
                for index in loader:
                    yield self.select_idxs(index)

        return iterate()
