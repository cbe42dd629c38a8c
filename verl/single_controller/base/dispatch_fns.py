"""The built-in dispatch and collect functions of the `Dispatch` modes (see `verl.single_controller.base.decorator`).

They are pure functions of the world size and the arguments: a dispatch function returns a `DispatchPlan` (one
`(args, kwargs)` call per rank plus what collection needs); a collect function turns the per-rank results and
the plan into the caller's result. `verl.single_controller.base.decorator` re-exports them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from verl.protocol import DP_PAD_ROWS_KEY, DataProto, pad_dataproto_to_divisor, unpad_dataproto

__all__ = [
    "DispatchPlan", "collect_all", "collect_dp_compute_proto", "collect_rank_zero", "dispatch_all_to_all",
    "dispatch_dp_compute", "dispatch_dp_compute_metric", "dispatch_dp_compute_proto", "dispatch_one_to_all",
    "dispatch_rank_zero",
]  # fmt: skip

Call = tuple[tuple, dict]
DispatchFn = Callable[[int, tuple, dict], "DispatchPlan"]
CollectFn = Callable[[Sequence[Any], "DispatchPlan"], Any]


@dataclass
class DispatchPlan:
    """The per-rank calls produced by a dispatch function, plus what its collect function needs.

    `calls[r]` is the `(args, kwargs)` for rank `r`; `pad_size` is the number of padding rows appended to the
    batch by `DP_COMPUTE_PROTO` and `padded_rows` the batch size after padding (both 0 for other modes).
    """

    calls: list[Call]
    pad_size: int = 0
    padded_rows: int = 0


def _check_world_size(world_size: int) -> None:
    """Raise unless `world_size` is a positive int."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"dispatch: world_size must be a positive int, got {world_size!r}")


def dispatch_rank_zero(world_size: int, args: tuple, kwargs: dict) -> DispatchPlan:
    """`Dispatch.RANK_ZERO`: a single call, for rank 0, with the arguments as given."""
    _check_world_size(world_size)
    return DispatchPlan(calls=[(tuple(args), dict(kwargs))])


def dispatch_one_to_all(world_size: int, args: tuple, kwargs: dict) -> DispatchPlan:
    """`Dispatch.ONE_TO_ALL`: every rank receives the same arguments."""
    _check_world_size(world_size)
    return DispatchPlan(calls=[(tuple(args), dict(kwargs)) for _ in range(world_size)])


def _split_lists(mode: str, world_size: int, args: tuple, kwargs: dict) -> DispatchPlan:
    """Give rank `r` item `r` of every argument; each argument must be a list/tuple of `world_size` items."""
    _check_world_size(world_size)
    named: list[tuple[str, Any]] = [(f"positional argument {i}", a) for i, a in enumerate(args)]
    named += [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]
    for where, value in named:
        if not isinstance(value, (list, tuple)) or len(value) != world_size:
            got = f"a {type(value).__name__} of length {len(value)}" if isinstance(value, (list, tuple)) else repr(type(value))
            raise ValueError(
                f"{mode}: {where} must be a list of world_size={world_size} items (one per rank), got {got}"
            )
    return DispatchPlan(
        calls=[(tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()}) for r in range(world_size)]
    )


def dispatch_all_to_all(world_size: int, args: tuple, kwargs: dict) -> DispatchPlan:
    """`Dispatch.ALL_TO_ALL`: rank `r` receives item `r` of every argument (each a list of `world_size` items)."""
    return _split_lists("ALL_TO_ALL", world_size, args, kwargs)


def dispatch_dp_compute(world_size: int, args: tuple, kwargs: dict) -> DispatchPlan:
    """`Dispatch.DP_COMPUTE`: rank `r` receives item `r` of every argument (each a list of `world_size` items)."""
    return _split_lists("DP_COMPUTE", world_size, args, kwargs)


def _chunk_protos(mode: str, world_size: int, args: tuple, kwargs: dict, pad: bool) -> DispatchPlan:
    """Chunk every DataProto argument over the ranks (padding first if `pad`); other arguments go to all ranks."""
    _check_world_size(world_size)
    named: list[tuple[str, Any]] = [(f"positional argument {i}", a) for i, a in enumerate(args)]
    named += [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]
    protos = [(where, value) for where, value in named if isinstance(value, DataProto)]
    if not protos:
        raise TypeError(f"{mode}: expects at least one DataProto argument, got types {[type(v).__name__ for _, v in named]}")
    first_where, first = protos[0]
    for where, value in protos[1:]:
        if len(value) != len(first):
            raise ValueError(
                f"{mode}: all DataProto arguments need the same batch size; {first_where} has {len(first)} rows, "
                f"{where} has {len(value)}"
            )
    if len(first) == 0:
        raise ValueError(f"{mode}: {first_where} is an empty DataProto; there is nothing to split over the ranks")

    pad_size = 0
    padded_rows = len(first)
    chunks: dict[str, list[DataProto]] = {}
    for where, value in protos:
        value = _without_pad_marker(value)
        if pad:
            value, pad_size = pad_dataproto_to_divisor(value, world_size)
            padded_rows = len(value)
        elif len(value) % world_size != 0:
            raise ValueError(
                f"{mode}: {where} has {len(value)} rows, not divisible by world_size={world_size} "
                "(this mode does not pad, so that metrics are not skewed by repeated rows)"
            )
        chunks[where] = value.chunk(world_size)
        if pad_size:
            _mark_padding_rows(chunks[where], padded_rows - pad_size)

    def pick(where: str, value: Any, rank: int) -> Any:
        return chunks[where][rank] if where in chunks else value

    n_args = len(args)
    calls = []
    for rank in range(world_size):
        rank_args = tuple(pick(where, value, rank) for where, value in named[:n_args])
        rank_kwargs = {key: pick(where, value, rank) for key, (where, value) in zip(kwargs, named[n_args:])}
        calls.append((rank_args, rank_kwargs))
    return DispatchPlan(calls=calls, pad_size=pad_size, padded_rows=padded_rows)


def _mark_padding_rows(chunks: list[DataProto], real_rows: int) -> None:
    """Set `meta_info[DP_PAD_ROWS_KEY]` on each chunk holding rows past the first `real_rows` (the padding)."""
    start = 0
    for chunk in chunks:
        end = start + len(chunk)
        padding = end - max(start, real_rows)
        if padding > 0:
            chunk.meta_info = {**chunk.meta_info, DP_PAD_ROWS_KEY: padding}
        start = end


def dispatch_dp_compute_proto(world_size: int, args: tuple, kwargs: dict) -> DispatchPlan:
    """`Dispatch.DP_COMPUTE_PROTO`: pad each DataProto argument to a multiple of the world size, give rank `r` chunk `r`."""
    return _chunk_protos("DP_COMPUTE_PROTO", world_size, args, kwargs, pad=True)


def dispatch_dp_compute_metric(world_size: int, args: tuple, kwargs: dict) -> DispatchPlan:
    """`Dispatch.DP_COMPUTE_METRIC`: give rank `r` chunk `r` of each DataProto argument (sizes must divide evenly)."""
    return _chunk_protos("DP_COMPUTE_METRIC", world_size, args, kwargs, pad=False)


def collect_all(outputs: Sequence[Any], plan: DispatchPlan) -> list[Any]:
    """Return the per-rank results as a list in rank order."""
    return list(outputs)


def collect_rank_zero(outputs: Sequence[Any], plan: DispatchPlan) -> Any:
    """Return rank 0's result."""
    if not outputs:
        raise ValueError("collect_rank_zero: no result to collect (rank 0 did not run)")
    return outputs[0]


def _without_pad_marker(data: DataProto) -> DataProto:
    """`data` without `meta_info[DP_PAD_ROWS_KEY]` (a worker may echo its input's meta_info), sharing the rows."""
    if DP_PAD_ROWS_KEY not in data.meta_info:
        return data
    meta_info = {key: value for key, value in data.meta_info.items() if key != DP_PAD_ROWS_KEY}
    return DataProto(batch=data.batch, non_tensor_batch=data.non_tensor_batch, meta_info=meta_info)


def collect_dp_compute_proto(outputs: Sequence[Any], plan: DispatchPlan) -> DataProto:
    """Concatenate the per-rank DataProto results in rank order and drop the padding rows added at dispatch.

    A result with row data must hold one row per (padded) input row whenever padding was added, since otherwise
    the padding rows cannot be located; results holding only `meta_info` (e.g. update metrics) are merged as is.
    """
    for rank, output in enumerate(outputs):
        if not isinstance(output, DataProto):
            raise TypeError(
                f"DP_COMPUTE_PROTO: rank {rank} returned a {type(output).__name__}; a method with this dispatch mode "
                "must return a DataProto"
            )
    merged = DataProto.concat([_without_pad_marker(output) for output in outputs])
    has_rows = merged.batch is not None or bool(merged.non_tensor_batch)
    if plan.pad_size == 0 or not has_rows:
        return merged
    if len(merged) != plan.padded_rows:
        raise ValueError(
            f"DP_COMPUTE_PROTO: the workers returned {len(merged)} rows for {plan.padded_rows} input rows (of which "
            f"{plan.pad_size} are padding); with padding each input row must give exactly one output row. "
            "Pass a batch whose size divides by the world size."
        )
    return unpad_dataproto(merged, plan.pad_size)
