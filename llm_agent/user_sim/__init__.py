"""The user simulator: an OpenAI-compatible service and the client the rollout loop talks to it with.

Service: `python -m llm_agent.user_sim.server` serves `POST /v1/chat/completions`, `GET /v1/models` and
`GET /health` with one of two backends, `scripted` (`scripted.py`, a deterministic persona driven by the scenario
YAML) or `hf` (`hf_backend.py`); both implement `backend.ChatBackend`. `faults.py` injects latency and faults.
Client: `client.UserSimClient` spreads a batch of turns over N instances (vLLM in production), with retries,
health probes and per-instance statistics (`client_stats.py`).
"""
