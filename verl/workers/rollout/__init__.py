"""Rollout engines: HF ``generate`` on the FSDP-sharded actor."""

from verl.workers.rollout.hf_rollout import HFRollout

__all__ = ["HFRollout"]
