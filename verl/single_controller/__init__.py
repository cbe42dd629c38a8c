"""Single controller: one driver process drives groups of workers (veRL style).

`base` holds the backend-independent parts (`Worker`, `WorkerGroup`, `@register` with `Dispatch`/`Execute`);
`ray` runs the workers as Ray actors in placement groups (`RayResourcePool`, `RayClassWithInitArgs`,
`RayWorkerGroup`).
"""

from typing import Any

from verl.single_controller.base import Worker, WorkerGroup

__all__ = ["RayClassWithInitArgs", "RayResourcePool", "RayWorkerGroup", "Worker", "WorkerGroup"]
_RAY_NAMES = ("RayClassWithInitArgs", "RayResourcePool", "RayWorkerGroup")


def __getattr__(name: str) -> Any:
    """The Ray backend's names, imported on first use: the workers themselves (``base``) run without Ray."""
    if name in _RAY_NAMES:
        from verl.single_controller import ray as ray_backend

        return getattr(ray_backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
