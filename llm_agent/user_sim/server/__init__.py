"""The user-simulator service: an OpenAI-compatible chat-completions server and its backends.

`python -m llm_agent.user_sim.server` (`app.py`) serves `POST /v1/chat/completions`, `GET /v1/models` and
`GET /health` with one of two backends, `scripted` (`scripted.py`, a deterministic persona driven by the scenario
YAML) or `hf` (`hf_backend.py`); both implement `backend.ChatBackend`. `chat_request.py` validates the request
body (its `ChatRequest` is the OpenAI wire request, not the client's `TurnRequest`), `http_guard.py` bounds the
transport, `faults.py` injects latency and faults, `repetition.py` keeps the persona from repeating itself.
Nothing here imports the client (`llm_agent.user_sim.client`).
"""
