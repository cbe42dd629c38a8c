"""`DataProtoFuture`: the result of a non-blocking worker-group call, collected when `get()` is called.

It holds the per-rank futures (Ray object refs), the function that combines the per-rank results (the collect
function of the dispatch mode) and optionally a function applied after that (e.g. taking one chunk). Passing a
`DataProtoFuture` to another worker-group method waits for it first (`get()`), on the driver.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from verl.protocol.data_proto import DataProto

__all__ = ["DataProtoFuture"]

_UNSET = object()


class DataProtoFuture:
    """Futures of a worker-group call plus how to combine them; `get()` waits (once) and returns the result.

    `collect_fn(outputs)` turns the list of per-rank results into the result; `dispatch_fn(result)`, when given,
    post-processes it. `wait_fn(futures)` waits and returns the per-rank results (default `ray.get`).
    """

    def __init__(
        self,
        collect_fn: Callable[[list[Any]], Any],
        futures: Sequence[Any],
        dispatch_fn: Callable[[Any], Any] | None = None,
        wait_fn: Callable[[Sequence[Any]], list[Any]] | None = None,
    ) -> None:
        self.collect_fn = collect_fn
        self.futures = list(futures)
        self.dispatch_fn = dispatch_fn
        self._wait_fn = wait_fn
        self._value: Any = _UNSET

    @staticmethod
    def concat(data: Sequence[Any]) -> DataProtoFuture:
        """A future of the concatenation (`DataProto.concat`) of the DataProtos behind the object refs `data`."""
        return DataProtoFuture(collect_fn=DataProto.concat, futures=data)

    def chunk(self, chunks: int) -> list[DataProtoFuture]:
        """`chunks` futures, the i-th resolving to chunk i of this future's DataProto (`DataProto.chunk`)."""
        if chunks < 1:
            raise ValueError(f"DataProtoFuture.chunk: chunks must be >= 1, got {chunks}")

        def take(i: int) -> Callable[[Any], Any]:
            return lambda data: data.chunk(chunks)[i]

        return [DataProtoFuture(self.collect_fn, self.futures, take(i), self._wait_fn) for i in range(chunks)]

    def get(self) -> Any:
        """Wait for the futures (on the first call), combine the results and return them."""
        if self._value is _UNSET:
            if self._wait_fn is None:
                import ray

                outputs = ray.get(self.futures)
            else:
                outputs = self._wait_fn(self.futures)
            value = self.collect_fn(list(outputs))
            self._value = value if self.dispatch_fn is None else self.dispatch_fn(value)
        return self._value
