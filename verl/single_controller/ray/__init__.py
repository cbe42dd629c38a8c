"""Ray backend of the single controller: placement-group resource pools and actor worker groups."""

from verl.single_controller.ray.base import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

__all__ = ["RayClassWithInitArgs", "RayResourcePool", "RayWorkerGroup"]
