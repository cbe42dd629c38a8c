"""The SEAD rollout loop, one concept per module.

`loop.py`: `LLMGenerationManager`, the trainer's rollout-loop plug-in (configs name it through
`llm_agent.generation`) and its hooks. `env.py`: `DialogueEnv`, the rules of one dialogue (agent turn, cache or
simulator answer, the six outcomes of `outcome.py`), free of I/O. `sync_loop.py` and `async_loop.py` only schedule
environments' steps (all dialogues per turn, or each at its own pace); `async_engine.py` micro-batches the async
mode's agent turns per rollout replica and `generation_call.py` builds a `generate_sequences` batch from the token
buffer. `dialogue.py`: the token buffer, the chat template's role markers and a dialogue's record; `records.py`:
`non_tensor_batch` columns and rollout-log lines; `user_profiles.py`: which user each row meets;
`step_outcomes.py`: what a training step tells the controller and the error-rate guard; `pacing.py`: where a
rollout's time went; `chat_layout.py`: a decoded context split back into chat messages; `config.py`:
`GenerationConfig`, the typed `rollout_loop.config`.
"""
