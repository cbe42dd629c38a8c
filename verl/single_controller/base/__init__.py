"""Backend-independent single-controller parts: the `Worker` base class, `WorkerGroup` and `@register`."""

from verl.single_controller.base.decorator import Dispatch, Execute, register
from verl.single_controller.base.worker import Worker
from verl.single_controller.base.worker_group import WorkerGroup, WorkerGroupError

__all__ = ["Dispatch", "Execute", "Worker", "WorkerGroup", "WorkerGroupError", "register"]
