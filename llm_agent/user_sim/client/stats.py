"""Bookkeeping of `llm_agent.user_sim.client.UserSimClient`: per-instance routing/health state and the counters.

`InstanceState` holds one simulator instance's routing state (in flight, consecutive failures, down, its load score
of `routing.py`) and its counters; `ClientStats` holds the client-wide counters and flattens everything into the metrics dict that
`UserSimClient.stats()` returns. Routing and health fields are touched only on the client's event-loop thread;
the counters are also read by `snapshot()` from the caller's thread, so every counter update and every read takes
`ClientStats.lock`.
"""
from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass, field

from llm_agent.user_sim.client.routing import LoadScore

LATENCY_WINDOW = 10_000  # successful-request latencies kept per instance for the percentiles
FAILURE_KINDS = ("timeout", "connection", "http", "garbage", "overloaded", "protocol")


@dataclass
class InstanceState:
    """Routing state and counters of one simulator instance.

    `retries` counts the retry attempts this instance received (a turn's 2nd, 3rd... attempt); `failovers` those
    of them that came from a different instance than the turn's previous attempt. `failures["protocol"]` counts
    its replies the caller refused (`TurnRequest.avoid`).
    """

    url: str
    name: str
    model: str | None
    in_flight: int = 0
    consecutive_failures: int = 0
    down: bool = False
    requests: int = 0
    successes: int = 0
    retries: int = 0
    failovers: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    marked_down: int = 0
    latencies: deque = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    load: LoadScore = field(default_factory=LoadScore)
    model_lock: asyncio.Lock | None = None
    probe_task: asyncio.Task | None = None


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated q-quantile (0 <= q <= 1) of a non-empty list."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


class ClientStats:
    """Client-wide counters (turns, turn failures, retries, failovers) and the per-instance counter updates."""

    def __init__(self, instances: list[InstanceState]) -> None:
        self.instances = instances
        self.lock = threading.Lock()
        self.turns = self.turn_failures = self.retries = self.failovers = 0

    def count_batch(self, turns: int, failed: int) -> None:
        """Record a finished batch of `turns` turns, `failed` of which came back as failures."""
        with self.lock:
            self.turns += turns
            self.turn_failures += failed

    def count_request(self, inst: InstanceState, previous: str | None) -> None:
        """Record a request sent to `inst`; `previous` is the instance of the turn's previous attempt, if any."""
        with self.lock:
            inst.requests += 1
            if previous is not None:
                failover = previous != inst.name
                inst.retries += 1
                inst.failovers += failover
                self.retries += 1
                self.failovers += failover

    def count_success(self, inst: InstanceState, latency_s: float) -> None:
        """Record an answered request and its latency."""
        with self.lock:
            inst.successes += 1
            inst.latencies.append(latency_s)

    def count_failure(self, inst: InstanceState, kind: str) -> None:
        """Record a failed request (or a refused reply) of `kind`, one of `FAILURE_KINDS`."""
        with self.lock:
            inst.failures[kind] = inst.failures.get(kind, 0) + 1

    def count_marked_down(self, inst: InstanceState) -> None:
        """Record that `inst` was taken out of rotation."""
        with self.lock:
            inst.marked_down += 1

    def snapshot(self) -> dict[str, float]:
        """Counters flattened for metrics: `user_sim/<host:port>/<name>` per instance plus `user_sim/<name>` totals.

        Per instance: requests, successes, failures (and failures_<kind> of each of `FAILURE_KINDS`), retries,
        failovers, marked_down, down (0/1), in_flight, latency_p50_s, latency_p95_s. Totals: requests, turns,
        turn_failures, retries, failovers (retries sent to a different instance), instances_down, latency_p50_s,
        latency_p95_s. Latency keys appear once some request has succeeded.
        """
        out: dict[str, float] = {}
        all_latencies: list[float] = []
        with self.lock:
            for inst in self.instances:
                prefix = f"user_sim/{inst.name}"
                out[f"{prefix}/requests"] = float(inst.requests)
                out[f"{prefix}/successes"] = float(inst.successes)
                out[f"{prefix}/failures"] = float(sum(inst.failures.values()))
                for kind in FAILURE_KINDS:
                    out[f"{prefix}/failures_{kind}"] = float(inst.failures.get(kind, 0))
                out[f"{prefix}/retries"] = float(inst.retries)
                out[f"{prefix}/failovers"] = float(inst.failovers)
                out[f"{prefix}/marked_down"] = float(inst.marked_down)
                out[f"{prefix}/down"] = float(inst.down)
                out[f"{prefix}/in_flight"] = float(inst.in_flight)
                latencies = list(inst.latencies)
                if latencies:
                    out[f"{prefix}/latency_p50_s"] = percentile(latencies, 0.5)
                    out[f"{prefix}/latency_p95_s"] = percentile(latencies, 0.95)
                all_latencies.extend(latencies)
            out["user_sim/requests"] = float(sum(inst.requests for inst in self.instances))
            out["user_sim/turns"] = float(self.turns)
            out["user_sim/turn_failures"] = float(self.turn_failures)
            out["user_sim/retries"] = float(self.retries)
            out["user_sim/failovers"] = float(self.failovers)
            out["user_sim/instances_down"] = float(sum(inst.down for inst in self.instances))
        if all_latencies:
            out["user_sim/latency_p50_s"] = percentile(all_latencies, 0.5)
            out["user_sim/latency_p95_s"] = percentile(all_latencies, 0.95)
        return out

    def reset(self) -> None:
        """Zero the counters and latency windows (health state and in-flight counts are kept)."""
        with self.lock:
            for inst in self.instances:
                inst.requests = inst.successes = inst.retries = inst.failovers = inst.marked_down = 0
                inst.failures.clear()
                inst.latencies.clear()
            self.turns = self.turn_failures = self.retries = self.failovers = 0
