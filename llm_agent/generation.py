"""`llm_agent.generation.LLMGenerationManager`: the name configs give the SEAD rollout loop
(`rollout_loop.path`); the loop itself is `llm_agent/rollout/` (`loop.py`)."""
from llm_agent.rollout.loop import CACHE_SNAPSHOT, LLMGenerationManager

__all__ = ["CACHE_SNAPSHOT", "LLMGenerationManager"]
