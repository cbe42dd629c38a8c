"""Rollout engines: HF ``generate`` on the FSDP-sharded actor, or a colocated vLLM engine (``vllm_rollout``)."""

from verl.workers.rollout.hf_rollout import HFRollout

__all__ = ["HFRollout"]
