"""The parts of the SEAD rollout loop (the loop itself is `llm_agent/generation.py`, the name configs use).

`config.py`: `GenerationConfig`, the typed `rollout_loop.config` block. `dialogue.py`: one dialogue's state, the
shared token buffer and the chat template's role markers. `chat_layout.py`: a decoded context split back into
chat messages (for agents that take messages, not token ids). `records.py`: per-dialogue `non_tensor_batch`
columns and rollout-log lines. `trainer_hooks.py`: the hooks the trainer calls (step end, validation end,
checkpoint state) and the simulator error-rate guard. `turns.py`: the rules of one turn, shared by both modes;
`async_loop.py` and `async_engine.py`: the async mode (a task per dialogue, agent turns batched per rollout
replica); `pacing.py`: where a rollout's time went (busy fractions, in-flight counts, dialogue durations).
"""
