"""Row arithmetic of the DataProto row operations: which rows, in which order, in which parts.

Every function here works on row counts, index arrays or the two row-carrying parts (`batch`, `non_tensor_batch`)
and knows nothing of `DataProto`; its methods (`reorder`, `repeat`, `chunk`, `make_iterator`, ...) turn these
indices into rows with `select_idxs` / `slice`. Contract violations raise `ContractError`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from torch.utils.data import DataLoader

from verl.errors import ContractError

__all__ = [
    "IndexLike", "as_index_array", "chunk_bounds", "mini_batch_indices", "padding_index", "permutation_index",
    "repeat_index", "rows_to_index", "sample_repeat_index", "split_bounds", "unfold_columns",
]  # fmt: skip

IndexLike = Sequence[int] | np.ndarray | torch.Tensor
"""Row indices: a list of ints, an int ndarray or tensor, or a boolean mask of the batch length."""


def as_index_array(idxs: IndexLike, length: int) -> np.ndarray:
    """Turn a list, ndarray, tensor (int or bool mask) into an int64 index array validated against `length`."""
    if isinstance(idxs, torch.Tensor):
        idxs = idxs.detach().cpu().numpy()
    array = np.asarray(idxs)
    if array.ndim != 1:
        raise IndexError(f"row indices must be 1-D, got shape {array.shape}")
    if array.dtype == bool:
        if array.shape[0] != length:
            raise IndexError(f"boolean mask has length {array.shape[0]}, but the batch has {length} rows")
        return np.flatnonzero(array)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(array.dtype, np.integer):
        raise IndexError(f"row indices must be integers or a boolean mask, got dtype {array.dtype}")
    if array.min() < -length or array.max() >= length:
        raise IndexError(f"row index out of range for a batch of {length} rows: min {array.min()}, max {array.max()}")
    return np.where(array < 0, array + length, array).astype(np.int64)


def rows_to_index(rows: list[int]) -> np.ndarray:
    """DataLoader collate function of `mini_batch_indices`: a list of row numbers -> an int64 index array."""
    return np.asarray(rows, dtype=np.int64)


def permutation_index(indices: IndexLike, length: int) -> np.ndarray:
    """`indices` as an index array, which must be a permutation of range(length) (`reorder`)."""
    index = as_index_array(indices, length)
    if not np.array_equal(np.sort(index), np.arange(length)):
        raise ContractError(
            f"reorder: indices must be a permutation of range({length}); got {len(index)} indices, "
            f"{len(np.unique(index))} distinct"
        )
    return index


def repeat_index(length: int, repeat_times: int, interleave: bool) -> np.ndarray:
    """Every row `repeat_times` times: interleaved (a a b b) or tiled (a b a b) (`repeat`)."""
    if repeat_times < 1:
        raise ContractError(f"repeat: repeat_times must be >= 1, got {repeat_times}")
    rows = np.arange(length)
    return np.repeat(rows, repeat_times) if interleave else np.tile(rows, repeat_times)


def sample_repeat_index(repeat_times: Sequence[int] | np.ndarray | torch.Tensor, length: int) -> np.ndarray:
    """Row i `repeat_times[i]` times, copies of a row together (a a a b c c for [3, 1, 2]) (`sample_level_repeat`)."""
    counts = repeat_times.detach().cpu().numpy() if isinstance(repeat_times, torch.Tensor) else repeat_times
    counts = np.asarray(list(counts) if isinstance(counts, tuple) else counts)
    if counts.ndim != 1 or len(counts) != length:
        raise ContractError(
            f"sample_level_repeat: repeat_times must be 1-D with one count per row ({length}), got shape {counts.shape}"
        )
    if counts.size and (not np.issubdtype(counts.dtype, np.integer) or counts.min() < 0):
        raise ContractError(f"sample_level_repeat: repeat_times must be non-negative ints, got {counts.tolist()}")
    return np.repeat(np.arange(length), counts.astype(np.int64))


def padding_index(length: int, padding_size: int, padding_candidate: str = "") -> np.ndarray | None:
    """All rows, then `padding_size` copies of the last row (the first with `padding_candidate="first"`); None when
    nothing is to be added (`padding`)."""
    if padding_size < 0:
        raise ContractError(f"padding: padding_size must be >= 0, got {padding_size}")
    if padding_size == 0:
        return None
    if length == 0:
        raise ContractError("padding: cannot pad an empty DataProto")
    source = 0 if padding_candidate == "first" else length - 1
    return np.concatenate([np.arange(length), np.full(padding_size, source)])


def chunk_bounds(length: int, chunks: int, allow_uneven: bool) -> list[tuple[int, int]]:
    """(start, end) of `chunks` consecutive parts; uneven only when allowed, then the first `length % chunks` parts
    get one row more (numpy's array_split) (`chunk`)."""
    if chunks < 1:
        raise ContractError(f"chunk: chunks must be >= 1, got {chunks}")
    if length % chunks != 0 and not allow_uneven:
        raise ContractError(
            f"chunk: only equal chunks are supported; batch size {length} is not divisible by chunks={chunks} "
            "(pad first with pad_dataproto_to_divisor, or enable auto_padding)"
        )
    bounds = np.cumsum([0] + [len(part) for part in np.array_split(np.arange(length), chunks)])
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(chunks)]


def split_bounds(length: int, split_size: int) -> list[tuple[int, int]]:
    """(start, end) of consecutive parts of `split_size` rows, the last possibly smaller (`split`)."""
    if split_size < 1:
        raise ContractError(f"split: split_size must be >= 1, got {split_size}")
    return [(i, min(i + split_size, length)) for i in range(0, length, split_size)]


def mini_batch_indices(
    length: int, mini_batch_size: int, epochs: int, seed: int | None = None, dataloader_kwargs: dict | None = None
) -> Iterator[np.ndarray]:
    """Index arrays of `mini_batch_size` rows for `epochs` passes over `length` rows (`make_iterator`).

    `dataloader_kwargs` go to the torch DataLoader over the row numbers (e.g. `{"shuffle": True}`); `seed` seeds
    its generator, so the shuffled order is reproducible. The size check happens here, before the first batch.
    """
    if mini_batch_size < 1 or length % mini_batch_size != 0:
        raise ContractError(f"make_iterator: batch size {length} is not divisible by mini_batch_size={mini_batch_size}")
    generator = None
    if seed is not None:
        generator = torch.Generator()
        generator.manual_seed(seed)
    loader = DataLoader(
        range(length), batch_size=mini_batch_size, collate_fn=rows_to_index, generator=generator,
        **(dataloader_kwargs or {}),
    )

    def iterate() -> Iterator[np.ndarray]:
        for _ in range(epochs):
            yield from loader

    return iterate()


def unfold_columns(
    batch: TensorDict | None, non_tensor_batch: dict[str, np.ndarray], n_split: int, split_keys: Sequence[str] | None
) -> tuple[TensorDict | None, dict[str, np.ndarray]]:
    """Cut dim 1 of each `split_keys` entry into `n_split` parts that become consecutive rows; every other entry is
    repeated `n_split` times (row i becomes rows i*n_split .. i*n_split + n_split - 1) (`unfold_column_chunks`)."""
    split = set(split_keys or ())
    parts = {**({} if batch is None else dict(batch.items())), **non_tensor_batch}
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

    new_batch = None
    if batch is not None:
        tensors = {key: unfold(key, value) for key, value in batch.items()}
        new_batch = TensorDict(tensors, batch_size=[batch.batch_size[0] * n_split], device=batch.device)
    return new_batch, {key: unfold(key, value) for key, value in non_tensor_batch.items()}
