"""PPO critic: token values and the clipped value update."""

from verl.workers.critic.dp_critic import DataParallelPPOCritic

__all__ = ["DataParallelPPOCritic"]
