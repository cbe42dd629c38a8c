"""The user simulator: the service (`server/`) and the client the rollout loop talks to it with (`client/`).

The two packages share no code: the client speaks OpenAI chat completions to any compatible endpoint (vLLM in
production), the server (`python -m llm_agent.user_sim.server`) is one such endpoint for CPU runs and tests.
"""
