"""`WorkerGroup`: the driver-side handle on a set of workers, one per rank.

A concrete group (e.g. `RayWorkerGroup`) says how to start calls on its ranks (`_launch`) and how to wait for
them (`_wait`); this base class binds every `@register`ed method of the worker class onto the group as a method
that dispatches the arguments, launches the per-rank calls, waits (when blocking) and collects the results.
A non-blocking call returns a `DataProtoFuture`; a `DataProtoFuture` passed as an argument is waited for first.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from verl.protocol import DataProtoFuture
from verl.single_controller.base.decorator import RegisterSpec, get_register_spec, resolve_dispatch_fns

__all__ = ["WorkerGroup", "WorkerGroupError"]


class WorkerGroupError(RuntimeError):
    """A worker method failed on one rank; carries the method name, the rank and the original exception."""

    def __init__(self, group: str, method: str, rank: int, cause: BaseException) -> None:
        self.group = group
        self.method = method
        self.rank = rank
        self.cause = cause
        super().__init__(f"{group}: {method}() failed on rank {rank}: {type(cause).__name__}: {cause}")


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

        def group_method(*args: Any, **kwargs: Any) -> Any:
            self._check_method(name)
            args = tuple(a.get() if isinstance(a, DataProtoFuture) else a for a in args)
            kwargs = {k: v.get() if isinstance(v, DataProtoFuture) else v for k, v in kwargs.items()}
            calls, collect = self._plan_calls(spec, args, kwargs)
            handles = self._launch(name, calls[:1] if spec.rank_zero_only else calls)
            finish = (lambda outputs: outputs[0]) if spec.rank_zero_only else collect
            future = DataProtoFuture(collect_fn=finish, futures=handles, wait_fn=lambda refs: self._wait(name, refs))
            return future.get() if spec.blocking else future

        group_method.__name__ = name
        group_method.__qualname__ = f"{type(self).__name__}.{name}"
        mode = getattr(spec.dispatch_mode, "name", "custom dispatch")
        group_method.__doc__ = (
            f"Run the worker method {name!r} on the group ({mode}, {spec.execute_mode.name}, blocking={spec.blocking})."
        )
        return group_method

    def _plan_calls(
        self, spec: RegisterSpec, args: tuple, kwargs: dict
    ) -> tuple[list[tuple[tuple, dict]], Callable[[list[Any]], Any]]:
        """The per-rank `(args, kwargs)` of a call and the function collecting the per-rank results.

        Built-in modes plan from the world size; user functions (veRL's convention) get the group itself, and
        the arguments they return are split over the ranks when every one is a list of world-size items.
        """
        dispatch_fn, collect_fn, plan_style = resolve_dispatch_fns(spec.dispatch_mode)
        if plan_style:
            plan = dispatch_fn(self.world_size, args, kwargs)
            return plan.calls, lambda outputs: collect_fn(outputs, plan)
        rank_args, rank_kwargs = dispatch_fn(self, *args, **kwargs)
        values = [*rank_args, *rank_kwargs.values()]
        n = self.world_size
        if values and all(isinstance(v, (list, tuple)) and len(v) == n for v in values):
            calls = [(tuple(a[r] for a in rank_args), {k: v[r] for k, v in rank_kwargs.items()}) for r in range(n)]
        else:
            calls = [(tuple(rank_args), dict(rank_kwargs))] * n
        return calls, lambda outputs: collect_fn(self, outputs)
