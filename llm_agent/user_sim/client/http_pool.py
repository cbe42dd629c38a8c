"""The simulator client's HTTP connections: one aiohttp connection pool, replies read whole and size-capped.

The client used httpx first. At 480 concurrent dialogues its per-request CPU (httpcore's pool bookkeeping, anyio
cancel scopes, sniffio lookups) was most of the rollout driver's CPU, and the driver, not the simulators, set the
pace of the async rollout loop (bench/async_rollout.py). aiohttp does the same work for under a third of the
CPU (0.42 against 1.46 ms per request, bench/user_sim_client_cpu.py, BENCHMARKS.md), and its connector's cost per
request does not grow with the pool. Every reply is read to its end here (so its connection goes back to the pool)
and refused beyond `max_response_bytes`, so a hostile or broken server cannot make the client buffer without bound.
Proxy variables (HTTP_PROXY, ...) and ~/.netrc are ignored: simulators are reached directly (honouring them costs
a thread hop and an environment scan per request in aiohttp).
"""
from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any

import aiohttp

from verl.utils.untrusted import load_json

__all__ = ["HTTPReply", "MAX_RESPONSE_BYTES", "ResponseTooLarge", "SimulatorHTTP"]

MAX_RESPONSE_BYTES = 8 << 20  # a chat completion is a few KB; more than this is not a simulator reply
KEEPALIVE_S = 3.0  # below uvicorn's (and so vLLM's) 5 s, so the client never reuses a connection the server closed


class ResponseTooLarge(aiohttp.ClientPayloadError):
    """A reply body over the size cap (its connection is closed, not reused)."""


@dataclass(frozen=True)
class HTTPReply:
    """A complete HTTP reply: status, body bytes, and the request's method and path (for error messages)."""

    status_code: int
    content: bytes
    method: str
    path: str

    @property
    def text(self) -> str:
        """The body as text (UTF-8, undecodable bytes replaced)."""
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body decoded by the project's policy for outside input (`verl.utils.untrusted.load_json`: a nesting
        limit, NaN refused, every string cleaned); `UntrustedInputError`, a ValueError, when it is not such JSON."""
        return load_json(self.content, what=f"{self.method} {self.path} reply", max_bytes=MAX_RESPONSE_BYTES)


class SimulatorHTTP:
    """`get` / `post` over one pool of at most `max_connections` keep-alive connections (create it inside the
    event loop that will use it). Transport failures raise `aiohttp.ClientError` or `TimeoutError`."""

    def __init__(self, max_connections: int, timeout_s: float, headers: dict[str, str],
                 max_response_bytes: int | None = None) -> None:
        self.max_response_bytes = MAX_RESPONSE_BYTES if max_response_bytes is None else max_response_bytes
        connector = aiohttp.TCPConnector(limit=max_connections, limit_per_host=0, keepalive_timeout=KEEPALIVE_S,
                                         ssl=ssl.create_default_context())
        self.session = aiohttp.ClientSession(
            connector=connector, headers=headers, trust_env=False,
            timeout=aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_read=timeout_s))

    async def _send(self, method: str, url: str, *, timeout: float | None = None, **kwargs: Any) -> HTTPReply:
        if timeout is not None:
            kwargs["timeout"] = aiohttp.ClientTimeout(total=timeout)
        async with self.session.request(method, url, **kwargs) as response:
            if (response.content_length or 0) > self.max_response_bytes:
                response.close()
                raise ResponseTooLarge(f"reply of {response.content_length} bytes is over the cap of "
                                       f"{self.max_response_bytes}")
            chunks, size = [], 0
            async for chunk in response.content.iter_any():
                size += len(chunk)
                if size > self.max_response_bytes:
                    response.close()
                    raise ResponseTooLarge(f"reply is over the cap of {self.max_response_bytes} bytes")
                chunks.append(chunk)
            body = b"".join(chunks)
            return HTTPReply(response.status, body, method, response.url.path)

    async def get(self, url: str, *, timeout: float | None = None) -> HTTPReply:
        """GET `url`; `timeout` (seconds) bounds the whole request when given."""
        return await self._send("GET", url, timeout=timeout)

    async def post(self, url: str, *, json: Any, timeout: float | None = None) -> HTTPReply:
        """POST `json` to `url`; `timeout` (seconds) bounds the whole request when given."""
        return await self._send("POST", url, json=json, timeout=timeout)

    async def aclose(self) -> None:
        """Close every connection."""
        await self.session.close()
