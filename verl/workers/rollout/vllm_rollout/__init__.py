"""The vLLM rollout engine (hybrid engine: a vLLM engine inside each actor-rollout worker).

Importing this package does not import vLLM; building a :class:`vLLMRollout` does.
"""

from verl.workers.rollout.vllm_rollout.actor_sync import sync_actor_weights
from verl.workers.rollout.vllm_rollout.vllm_rollout import vllm_available, vLLMRollout
from verl.workers.rollout.vllm_rollout.weight_sync import WeightSyncStats, fsdp_weight_stream

__all__ = ["WeightSyncStats", "fsdp_weight_stream", "sync_actor_weights", "vLLMRollout", "vllm_available"]
