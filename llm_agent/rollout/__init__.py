"""The SEAD rollout loop, one concept per module.

`loop.py`: `LLMGenerationManager`, the trainer's rollout-loop plug-in (configs name it through
`llm_agent.generation`), its hooks and the sync schedule (all active dialogues per turn); `async_loop.py` the async
one (each dialogue at its own pace) and `async_engine.py` micro-batches its agent turns per rollout replica. The
environments (`DialogueEnv`, the token buffer, the chat markers, the agent-turn batches) live in `llm_agent.envs`,
the engine contract and a turn batch (`TurnBatch`, `SampledTurn`) in `verl.workers.rollout.engine`.
`dialogue_record.py`: the typed record of a dialogue; `records.py`: `non_tensor_batch` columns and rollout-log
lines; `user_profiles.py`: which user each row meets; `step_outcomes.py`: what a training step tells the controller
and the error-rate guard; `pacing.py`: where a rollout's time went; `chat_layout.py`: a decoded context split back
into chat messages; `config.py`: `GenerationConfig`, the typed `rollout_loop.config`; `outcome.py`: the six
outcomes.
"""
