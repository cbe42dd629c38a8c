"""Private helpers shared by :mod:`verl.trainer.ppo.advantages` and :mod:`verl.trainer.ppo.core_algos`:
the (batch, response_length) shape check, the read of a key from a dict-like or attribute config, and the
name-registry decorator behind ``register_adv_est`` and ``register_policy_loss``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch


def _check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise ValueError naming the arguments when the given (bs, T) tensors do not share one 2-D shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    first = next(iter(shapes.values()))
    if len(first) != 2 or any(shape != first for shape in shapes.values()):
        raise ValueError(f"expected tensors of one (batch, response_length) shape, got {shapes}")


def _cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    """Read ``key`` from a mapping (dict, DictConfig) or an attribute object (None: nothing), else ``default``."""
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _registering_decorator(registry: dict[str, Callable], name: str, kind: str) -> Callable[[Callable], Callable]:
    """Decorator storing a function in ``registry`` under ``name``; a different function there already is an error."""

    def decorator(fn: Callable) -> Callable:
        existing = registry.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(f"{kind} {name!r} is already registered to {existing.__qualname__}")
        registry[name] = fn
        return fn

    return decorator
