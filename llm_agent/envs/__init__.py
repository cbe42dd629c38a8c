"""Environments of the rollout loop: the contract (`Environment`), the registry of kinds and the shipped kind.

`base.py` holds the contract, `Step`, `EnvContext`, the shared `TokenBuffer` (and `AgentBatches`, the generation
batches built from it) and the registry (`register_env`, `env_class`); `dialogue.py` the dialogue environment,
registered here as `dialogue` (the default of `rollout_loop.config.env`).
"""
from llm_agent.envs.base import (ENV_COLUMN, AgentBatches, ChatMarkers, EnvContext, Environment, Step, TokenBuffer,
                                 env_class, register_env, registered_envs)
from llm_agent.envs.dialogue import Dialogue, DialogueEnv, RequestSeeds, stable_seed

DEFAULT_ENV = "dialogue"
register_env(DEFAULT_ENV, DialogueEnv)

__all__ = ["DEFAULT_ENV", "ENV_COLUMN", "AgentBatches", "ChatMarkers", "Dialogue", "DialogueEnv", "EnvContext",
           "Environment", "RequestSeeds", "Step", "TokenBuffer", "env_class", "register_env", "registered_envs",
           "stable_seed"]
