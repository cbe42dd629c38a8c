"""Single controller: one driver process drives groups of workers (veRL style).

`base` holds the backend-independent parts (`Worker`, `WorkerGroup`, `@register` with `Dispatch`/`Execute`);
`ray` runs the workers as Ray actors in placement groups (`RayResourcePool`, `RayClassWithInitArgs`,
`RayWorkerGroup`).
"""

from verl.single_controller.base import Worker, WorkerGroup
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

__all__ = ["RayClassWithInitArgs", "RayResourcePool", "RayWorkerGroup", "Worker", "WorkerGroup"]
