"""PPO actor: log-probabilities and the clipped policy update."""

from verl.workers.actor.dp_actor import DataParallelPPOActor

__all__ = ["DataParallelPPOActor"]
