"""Injected latency and faults for the simulator server (client tests, dispatch benchmarks). Off by default.

Latency is lognormal with a given median and log-space sigma (a heavy right tail, like a loaded inference
server). Faults, applied to `POST /v1/chat/completions` only (`/health` stays truthful about the process):

- ``garbage``: HTTP 200 whose body is not a valid chat completion (alternately non-JSON bytes and JSON with
  the wrong shape), the failure a client must detect rather than trust;
- ``hang``: the request never gets an answer (the handler waits until the client drops the connection);
- ``error``: HTTP 503 in OpenAI's error shape, the only 5xx the server ever sends on purpose.

`fault_rate` makes only that share of requests fail (drawn from the seeded generator).
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import threading
from dataclasses import dataclass
from typing import Awaitable, Callable

logger = logging.getLogger(__name__)

FAULT_KINDS = ("none", "garbage", "hang", "error")


@dataclass(frozen=True)
class FaultConfig:
    """Settings of the injector: latency median (ms) and sigma, fault kind and the share of requests hit."""

    latency_median_ms: float = 0.0
    latency_sigma: float = 0.0
    fault: str = "none"
    fault_rate: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.latency_median_ms < 0:
            raise ValueError(f"inject-latency-ms must be >= 0, got {self.latency_median_ms}")
        if self.latency_sigma < 0:
            raise ValueError(f"inject-latency-sigma must be >= 0, got {self.latency_sigma}")
        if self.fault not in FAULT_KINDS:
            raise ValueError(f"inject-fault must be one of {FAULT_KINDS}, got {self.fault!r}")
        if not 0.0 <= self.fault_rate <= 1.0:
            raise ValueError(f"fault-rate must be in [0, 1], got {self.fault_rate}")

    @property
    def active(self) -> bool:
        """True when any latency or fault is configured."""
        return self.latency_median_ms > 0 or self.fault != "none"


class FaultInjector:
    """Draws per-request latency and fault decisions from one seeded generator (thread-safe)."""

    def __init__(self, config: FaultConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)
        self._lock = threading.Lock()
        self._garbage_count = 0

    def sample_latency_s(self) -> float:
        """Seconds to wait: median * exp(sigma * z), z ~ N(0, 1); 0 when no latency is configured."""
        if self.config.latency_median_ms <= 0:
            return 0.0
        with self._lock:
            z = self._rng.gauss(0.0, 1.0)
        return self.config.latency_median_ms / 1000.0 * math.exp(self.config.latency_sigma * z)

    def draw_fault(self) -> str:
        """The fault for this request ('none' when off or when the rate draw spares it)."""
        if self.config.fault == "none":
            return "none"
        with self._lock:
            hit = self.config.fault_rate >= 1.0 or self._rng.random() < self.config.fault_rate
        return self.config.fault if hit else "none"

    def garbage_body(self) -> bytes:
        """A 200 body a client must reject: non-JSON bytes or JSON missing a valid `choices` list, alternately."""
        with self._lock:
            self._garbage_count += 1
            count = self._garbage_count
        if count % 2 == 1:
            return b"\x00\xffnot json at all {\"choices\": ["
        return json.dumps({"id": "garbage", "object": "chat.completion", "choices": "oops"}).encode()

    async def delay(self) -> None:
        """Sleep for one sampled latency."""
        seconds = self.sample_latency_s()
        if seconds > 0:
            await asyncio.sleep(seconds)

    @staticmethod
    async def hang(is_disconnected: Callable[[], Awaitable[bool]], poll_s: float = 0.5) -> None:
        """Never answer: wait until the client drops the connection (then return so nothing leaks)."""
        logger.debug("injected fault: hanging a request")
        while not await is_disconnected():
            await asyncio.sleep(poll_s)
