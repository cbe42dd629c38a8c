"""The simulator client's HTTP connections: several small httpx connection pools instead of one large one.

httpcore 1.0 re-examines every connection of a pool each time a request enters or leaves it (a socket check
per connection, and a count over all connections for each idle one), so with one pool of 256 connections the
client spent ~7 ms of CPU per request at 480 dialogues (bench/async_rollout.py, BENCHMARKS.md): more than the
simulated latency. Each request here goes to the pool with the fewest requests in flight, and every pool holds
at most `SHARD_CONNECTIONS` connections, which bounds that work per request by a constant.
"""
from __future__ import annotations

import asyncio
import math
import ssl
from typing import Any

import httpx

__all__ = ["SHARD_CONNECTIONS", "ShardedHTTP"]

SHARD_CONNECTIONS = 8  # connections per pool


class ShardedHTTP:
    """`get` / `post` like `httpx.AsyncClient`, over ceil(max_connections / SHARD_CONNECTIONS) pools."""

    def __init__(self, max_connections: int, timeout_s: float, headers: dict[str, str]) -> None:
        shards = max(1, math.ceil(max_connections / SHARD_CONNECTIONS))
        per_shard = math.ceil(max_connections / shards)
        limits = httpx.Limits(max_connections=per_shard, max_keepalive_connections=per_shard)
        tls = ssl.create_default_context()  # one certificate store for all pools (building one takes ~70 ms)
        self.clients = [httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s), headers=headers,
                                          verify=tls) for _ in range(shards)]
        self.in_flight = [0] * shards

    async def _send(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        index = min(range(len(self.clients)), key=self.in_flight.__getitem__)
        self.in_flight[index] += 1
        try:
            return await self.clients[index].request(method, url, **kwargs)
        finally:
            self.in_flight[index] -= 1

    async def get(self, url: str, **kwargs: Any) -> httpx.Response:
        """GET `url` on the least busy pool."""
        return await self._send("GET", url, **kwargs)

    async def post(self, url: str, **kwargs: Any) -> httpx.Response:
        """POST to `url` on the least busy pool."""
        return await self._send("POST", url, **kwargs)

    async def aclose(self) -> None:
        """Close every pool's connections."""
        await asyncio.gather(*(client.aclose() for client in self.clients))
