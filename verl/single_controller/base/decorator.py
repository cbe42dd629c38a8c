"""`@register`: how a worker-group call is split over the ranks, where it runs and how the results are gathered.

A worker method decorated with `@register(dispatch_mode, execute_mode, blocking)` becomes a method of the
worker group with the same name. Calling it on the group

1. *dispatches*: the dispatch function of `dispatch_mode` turns the caller's arguments into one
   `(args, kwargs)` call per rank (a `DispatchPlan`);
2. *executes*: the group runs the calls remotely, on every rank (`Execute.ALL`) or on rank 0 only
   (`Execute.RANK_ZERO`, or `Dispatch.RANK_ZERO`);
3. *collects*: the collect function of `dispatch_mode` turns the per-rank results into the caller's result.

The dispatch and collect functions are pure functions of the world size and the arguments, so they are tested
without any worker.

Dispatch modes (veRL names and semantics):

| mode | each rank receives | the caller gets |
|---|---|---|
| `RANK_ZERO` | rank 0 alone runs, with the arguments as given | rank 0's result |
| `ONE_TO_ALL` | the same arguments | a list of the results, in rank order |
| `ALL_TO_ALL` | item `r` of every argument (each a list of `world_size` items) | a list of the results |
| `DP_COMPUTE` | as `ALL_TO_ALL` (the data-parallel spelling) | a list of the results |
| `DP_COMPUTE_PROTO` | chunk `r` of every `DataProto` argument, padded first to a multiple of the world size; other arguments as given | one `DataProto`: the chunks' results concatenated, padding rows removed |
| `DP_COMPUTE_METRIC` | chunk `r` of every `DataProto` argument (no padding: the batch must divide evenly); other arguments as given | a list of the results |

Padding repeats the batch's leading rows, so with `DP_COMPUTE_PROTO` a batch that does not divide by the world
size gets a few rows computed twice. For inference that is harmless (the duplicates are dropped at collection).
So that an update does not train on them twice, the chunk of a rank that holds padding rows says how many in
`meta_info[DP_PAD_ROWS_KEY]` (they are always its last rows); the PPO actor and critic give them no loss.

veRL's extension API is supported: `register_dispatch_mode(name, dispatch_fn, collect_fn)` adds `Dispatch.<name>`,
`update_dispatch_mode` replaces a mode's functions, `get_predefined_dispatch_fn(mode)` returns them, and
`register(dispatch_mode={"dispatch_fn": ..., "collect_fn": ...})` (e.g. `make_nd_compute_dataproto_dispatch_fn`)
uses a pair directly. Such user functions follow veRL's calling convention: `dispatch_fn(worker_group, *args,
**kwargs) -> (args, kwargs)`, where an argument that is a list of world-size items is split over the ranks
(when all are) and `collect_fn(worker_group, outputs)`. The built-in functions (`verl.single_controller.base.
dispatch_fns`) are pure functions of the world size instead, marked as such in `DISPATCH_MODE_FN_REGISTRY`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

from verl.errors import ContractError
from verl.protocol import DP_PAD_ROWS_KEY
from verl.single_controller.base.dispatch_fns import (
    CollectFn,
    DispatchFn,
    DispatchPlan,
    collect_all,
    collect_dp_compute_proto,
    collect_rank_zero,
    dispatch_all_to_all,
    dispatch_dp_compute,
    dispatch_dp_compute_metric,
    dispatch_dp_compute_proto,
    dispatch_one_to_all,
    dispatch_rank_zero,
)
from verl.single_controller.base.dynamic_enum import DynamicEnum
from verl.single_controller.base.nd_dispatch import make_nd_compute_dataproto_dispatch_fn

__all__ = [
    "DISPATCH_MODE_FN_REGISTRY", "DP_PAD_ROWS_KEY", "REGISTER_ATTR", "Dispatch", "DispatchPlan", "Execute",
    "RegisterSpec", "collect_all", "collect_dp_compute_proto", "collect_rank_zero", "dispatch_all_to_all",
    "dispatch_dp_compute", "dispatch_dp_compute_metric", "dispatch_dp_compute_proto", "dispatch_one_to_all",
    "dispatch_rank_zero", "get_dispatch_fns", "get_predefined_dispatch_fn", "get_register_spec",
    "make_nd_compute_dataproto_dispatch_fn", "register", "register_dispatch_mode", "resolve_dispatch_fns",
    "update_dispatch_mode",
]  # fmt: skip

REGISTER_ATTR = "_verl_register_spec"
"""Name of the attribute `register` sets on a worker method."""

F = TypeVar("F", bound=Callable[..., Any])
FnPair = Mapping[str, Callable[..., Any]]


class Dispatch(DynamicEnum):
    """How a worker-group call is split over the ranks and how the results are gathered (see the module docstring).

    Members: RANK_ZERO, ONE_TO_ALL, ALL_TO_ALL, DP_COMPUTE, DP_COMPUTE_PROTO, DP_COMPUTE_METRIC, plus those added
    by `register_dispatch_mode`.
    """


for _name in ("RANK_ZERO", "ONE_TO_ALL", "ALL_TO_ALL", "DP_COMPUTE", "DP_COMPUTE_PROTO", "DP_COMPUTE_METRIC"):
    Dispatch.register(_name)


class Execute(Enum):
    """Which ranks run a worker-group call: all of them, or rank 0 only (whose result is returned as is)."""

    ALL = "all"
    RANK_ZERO = "rank_zero"


def _builtin(dispatch_fn: DispatchFn, collect_fn: CollectFn) -> dict[str, Any]:
    """A registry entry of built-in (world-size based, `DispatchPlan`) functions."""
    return {"dispatch_fn": dispatch_fn, "collect_fn": collect_fn, "plan_style": True}


DISPATCH_MODE_FN_REGISTRY: dict[Dispatch, dict[str, Any]] = {
    Dispatch.RANK_ZERO: _builtin(dispatch_rank_zero, collect_rank_zero),
    Dispatch.ONE_TO_ALL: _builtin(dispatch_one_to_all, collect_all),
    Dispatch.ALL_TO_ALL: _builtin(dispatch_all_to_all, collect_all),
    Dispatch.DP_COMPUTE: _builtin(dispatch_dp_compute, collect_all),
    Dispatch.DP_COMPUTE_PROTO: _builtin(dispatch_dp_compute_proto, collect_dp_compute_proto),
    Dispatch.DP_COMPUTE_METRIC: _builtin(dispatch_dp_compute_metric, collect_all),
}
"""`{mode: {"dispatch_fn", "collect_fn"[, "plan_style"]}}`; entries without `plan_style` use veRL's convention."""


def _check_dispatch_mode(dispatch_mode: Any) -> None:
    """Raise TypeError unless `dispatch_mode` is a registered Dispatch member or a dispatch/collect function pair."""
    if isinstance(dispatch_mode, Mapping):
        missing = {"dispatch_fn", "collect_fn"} - set(dispatch_mode)
        if missing or not all(callable(dispatch_mode[k]) for k in ("dispatch_fn", "collect_fn")):
            raise TypeError(f"register: a dispatch_mode dict needs callable 'dispatch_fn' and 'collect_fn', got "
                            f"{sorted(dispatch_mode)}")
    elif not (isinstance(dispatch_mode, Dispatch) and dispatch_mode in Dispatch):
        raise TypeError(f"register: dispatch_mode must be a Dispatch member (or a dispatch/collect dict), "
                        f"got {dispatch_mode!r}")


def register_dispatch_mode(name: str, dispatch_fn: Callable[..., Any], collect_fn: Callable[..., Any]) -> None:
    """Add `Dispatch.<name>` with user functions (veRL's convention, see the module docstring)."""
    if not (callable(dispatch_fn) and callable(collect_fn)):
        raise TypeError("register_dispatch_mode: dispatch_fn and collect_fn must be callable")
    mode = Dispatch.register(name)
    DISPATCH_MODE_FN_REGISTRY[mode] = {"dispatch_fn": dispatch_fn, "collect_fn": collect_fn}


def update_dispatch_mode(
    dispatch_mode: Dispatch, dispatch_fn: Callable[..., Any], collect_fn: Callable[..., Any]
) -> None:
    """Replace the functions of an existing mode by user functions (veRL's convention)."""
    _check_dispatch_mode(dispatch_mode)
    if not (callable(dispatch_fn) and callable(collect_fn)):
        raise TypeError("update_dispatch_mode: dispatch_fn and collect_fn must be callable")
    DISPATCH_MODE_FN_REGISTRY[dispatch_mode] = {"dispatch_fn": dispatch_fn, "collect_fn": collect_fn}


def get_predefined_dispatch_fn(dispatch_mode: Dispatch) -> dict[str, Callable[..., Any]]:
    """`{"dispatch_fn": ..., "collect_fn": ...}` of a registered mode."""
    _check_dispatch_mode(dispatch_mode)
    if dispatch_mode not in DISPATCH_MODE_FN_REGISTRY:
        raise ContractError(f"dispatch mode {dispatch_mode!r} has no registered functions")
    entry = DISPATCH_MODE_FN_REGISTRY[dispatch_mode]
    return {"dispatch_fn": entry["dispatch_fn"], "collect_fn": entry["collect_fn"]}


def resolve_dispatch_fns(dispatch_mode: Dispatch | FnPair) -> tuple[Callable[..., Any], Callable[..., Any], bool]:
    """`(dispatch_fn, collect_fn, plan_style)` for a mode or a function pair; plan_style marks the built-ins."""
    _check_dispatch_mode(dispatch_mode)
    entry = dispatch_mode if isinstance(dispatch_mode, Mapping) else DISPATCH_MODE_FN_REGISTRY.get(dispatch_mode)
    if entry is None:
        raise ContractError(f"dispatch mode {dispatch_mode!r} has no registered functions")
    return entry["dispatch_fn"], entry["collect_fn"], bool(entry.get("plan_style", False))


def get_dispatch_fns(mode: Dispatch) -> tuple[DispatchFn, CollectFn]:
    """Return the built-in `(dispatch_fn, collect_fn)` pair (world-size based) of a built-in dispatch mode."""
    dispatch_fn, collect_fn, plan_style = resolve_dispatch_fns(mode)
    if not plan_style:
        raise ValueError(f"dispatch mode {mode!r} uses user functions (veRL's convention), not built-in ones")
    return dispatch_fn, collect_fn


@dataclass(frozen=True)
class RegisterSpec:
    """What `register` attached to a worker method: its dispatch mode, execute mode and blocking flag."""

    dispatch_mode: Dispatch | FnPair
    execute_mode: Execute
    blocking: bool

    @property
    def rank_zero_only(self) -> bool:
        """True when only rank 0 runs the method (`Dispatch.RANK_ZERO` or `Execute.RANK_ZERO`)."""
        return self.dispatch_mode is Dispatch.RANK_ZERO or self.execute_mode is Execute.RANK_ZERO


def register(
    dispatch_mode: Dispatch | FnPair = Dispatch.ALL_TO_ALL,
    execute_mode: Execute = Execute.ALL,
    blocking: bool = True,
    materialize_futures: bool = True,
) -> Callable[[F], F]:
    """Mark a worker method for binding onto its worker group with the given dispatch/execute modes.

    The method itself is returned unchanged (it still runs as written inside the worker); only a `RegisterSpec`
    is attached to it. With `blocking=False` the group method returns a `DataProtoFuture` whose `get()` waits.
    `dispatch_mode` may also be a `{"dispatch_fn", "collect_fn"}` dict. `materialize_futures` (veRL's flag) is
    accepted; a `DataProtoFuture` argument is always waited for on the driver before dispatch.
    """
    _check_dispatch_mode(dispatch_mode)
    if not isinstance(execute_mode, Execute):
        raise TypeError(f"register: execute_mode must be an Execute member, got {execute_mode!r}")
    if not isinstance(blocking, bool):
        raise TypeError(f"register: blocking must be a bool, got {blocking!r}")
    spec = RegisterSpec(dispatch_mode=dispatch_mode, execute_mode=execute_mode, blocking=blocking)

    def decorator(func: F) -> F:
        if not callable(func):
            raise TypeError(f"register: can only decorate a function, got {func!r}")
        setattr(func, REGISTER_ATTR, spec)
        return func

    return decorator


def get_register_spec(method: Any) -> RegisterSpec | None:
    """Return the `RegisterSpec` attached by `register` to `method`, or None if it was not registered."""
    spec = getattr(method, REGISTER_ATTR, None)
    return spec if isinstance(spec, RegisterSpec) else None
