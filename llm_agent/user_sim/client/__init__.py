"""The user-simulator client side: the `SimulatorClient` contract and the HTTP client over N instances.

`protocol.py`: `SimulatorClient` and its request/answer types (`TurnRequest`, `TurnReply`, `TurnFailure`);
`http_client.py`: `UserSimClient`, the fault-tolerant client for OpenAI-compatible instances (vLLM in production,
`python -m llm_agent.user_sim.server` on CPU); `config.py`: `UserSimConfig` (`rollout_loop.config.user_sim`);
`stats.py` its per-instance health and counters; `wire.py` URL parsing, response checks and the client's errors;
`http_pool.py` its aiohttp connections. Nothing here imports the server (`llm_agent.user_sim.server`).
"""
from llm_agent.user_sim.client.config import UserSimConfig
from llm_agent.user_sim.client.http_client import UserSimClient
from llm_agent.user_sim.client.protocol import SimulatorClient, TurnFailure, TurnReply, TurnRequest, TurnResult
from llm_agent.user_sim.client.wire import SimulatorCheckError, parse_urls

__all__ = ["SimulatorCheckError", "SimulatorClient", "TurnFailure", "TurnReply", "TurnRequest", "TurnResult",
           "UserSimClient", "UserSimConfig", "parse_urls"]
