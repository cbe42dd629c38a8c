"""`WorkerGroup`: the driver-side handle on a set of workers, one per rank.

A concrete group (e.g. `RayWorkerGroup`) says how to start calls on its ranks (`_launch`) and how to wait for
them (`_wait`); this base class binds every `@register`ed method of the worker class onto the group as a method
that dispatches the arguments, launches the per-rank calls, waits (when blocking) and collects the results.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from verl.single_controller.base.decorator import DispatchPlan, RegisterSpec, get_dispatch_fns, get_register_spec

__all__ = ["PendingResult", "WorkerGroup", "WorkerGroupError"]


class WorkerGroupError(RuntimeError):
    """A worker method failed on one rank; carries the method name, the rank and the original exception."""

    def __init__(self, group: str, method: str, rank: int, cause: BaseException) -> None:
        self.group = group
        self.method = method
        self.rank = rank
        self.cause = cause
        super().__init__(f"{group}: {method}() failed on rank {rank}: {type(cause).__name__}: {cause}")


class PendingResult:
    """The result of a non-blocking worker-group call; `get()` waits for the ranks and returns the collected value."""

    def __init__(self, finish: Callable[[], Any]) -> None:
        self._finish = finish
        self._done = False
        self._value: Any = None

    def get(self) -> Any:
        """Wait for every rank (on the first call) and return the collected result."""
        if not self._done:
            self._value = self._finish()
            self._done = True
        return self._value


class WorkerGroup(ABC):
    """Driver-side group of workers of one class; exposes the class's `@register`ed methods as group methods."""

    def __init__(self, name: str) -> None:
        self._name = name

    @property
    def name(self) -> str:
        """A name for this group, used in logs and error messages."""
        return self._name

    @property
    @abstractmethod
    def world_size(self) -> int:
        """The number of workers (ranks) in the group."""

    @abstractmethod
    def _check_method(self, method: str) -> None:
        """Raise if the group cannot run worker method `method` now (unknown method, group shut down)."""

    @abstractmethod
    def _launch(self, method: str, calls: Sequence[tuple[tuple, dict]]) -> list[Any]:
        """Start `method` on ranks 0..len(calls)-1 with `calls[r] = (args, kwargs)`; return one handle per rank."""

    @abstractmethod
    def _wait(self, method: str, handles: Sequence[Any]) -> list[Any]:
        """Wait for the handles of `_launch` and return the results in rank order; raise `WorkerGroupError` on failure."""

    def _bind_worker_methods(self, worker_cls: type) -> list[str]:
        """Create a group method for every `@register`ed method of `worker_cls`; return their names.

        Raises if a registered name would shadow an attribute the group already has (e.g. `world_size`).
        """
        bound = []
        for name, member in inspect.getmembers(worker_cls):
            spec = get_register_spec(member)
            if spec is None:
                continue
            if hasattr(self, name):
                raise ValueError(
                    f"{worker_cls.__name__}.{name} is @register'ed, but {type(self).__name__} already has an attribute "
                    f"{name!r}; rename the worker method"
                )
            setattr(self, name, self._make_group_method(name, spec))
            bound.append(name)
        return bound

    def _make_group_method(self, name: str, spec: RegisterSpec) -> Callable[..., Any]:
        """Build the group method for worker method `name`: dispatch, launch, wait (if blocking), collect."""
        dispatch_fn, collect_fn = get_dispatch_fns(spec.dispatch_mode)

        def group_method(*args: Any, **kwargs: Any) -> Any:
            self._check_method(name)
            plan: DispatchPlan = dispatch_fn(self.world_size, args, kwargs)
            calls = plan.calls[:1] if spec.rank_zero_only else plan.calls
            handles = self._launch(name, calls)

            def finish() -> Any:
                outputs = self._wait(name, handles)
                if spec.rank_zero_only:
                    return outputs[0]
                return collect_fn(outputs, plan)

            return finish() if spec.blocking else PendingResult(finish)

        group_method.__name__ = name
        group_method.__qualname__ = f"{type(self).__name__}.{name}"
        group_method.__doc__ = (
            f"Run the worker method {name!r} on the group ({spec.dispatch_mode.name}, {spec.execute_mode.name}, "
            f"blocking={spec.blocking})."
        )
        return group_method
