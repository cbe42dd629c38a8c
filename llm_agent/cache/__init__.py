"""The user-response cache: stage-aware reuse of the simulator's replies during training.

`UserResponseCache` (`response_cache.py`) stores and serves replies and persists them as JSONL; `CacheConfig`
(`config.py`) is its typed `rollout_loop.config.cache` block.
"""
from llm_agent.cache.config import CacheConfig
from llm_agent.cache.response_cache import CachedReply, UserResponseCache

__all__ = ["CacheConfig", "CachedReply", "UserResponseCache"]
