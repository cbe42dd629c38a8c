"""The client's bookkeeping (llm_agent/user_sim/client/stats.py): counters, percentiles and the metrics keys."""
from __future__ import annotations

import threading

import pytest

from llm_agent.user_sim.client.stats import ClientStats, InstanceState, percentile


def test_percentile_interpolates_linearly():
    assert percentile([3.0], 0.95) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == pytest.approx(2.5)
    assert percentile(list(map(float, range(101))), 0.95) == pytest.approx(95.0)


def test_retries_and_failovers_are_counted_per_instance_and_in_total():
    a, b = InstanceState("http://127.0.0.1:1", "127.0.0.1:1", None), InstanceState("http://127.0.0.1:2", "127.0.0.1:2",
                                                                                   None)
    stats = ClientStats([a, b])
    stats.count_request(a, None)          # first attempt on a
    stats.count_failure(a, "timeout")
    stats.count_request(b, a.name)        # retry elsewhere: a failover to b
    stats.count_success(b, 0.25)
    stats.count_request(b, None)
    stats.count_failure(b, "http")
    stats.count_request(b, b.name)        # retry on the same instance: not a failover
    stats.count_success(b, 0.75)
    stats.count_batch(2, 0)
    out = stats.snapshot()
    assert out["user_sim/127.0.0.1:1/requests"] == 1 and out["user_sim/127.0.0.1:2/requests"] == 3
    assert out["user_sim/127.0.0.1:2/retries"] == 2 and out["user_sim/127.0.0.1:2/failovers"] == 1
    assert out["user_sim/127.0.0.1:1/retries"] == 0 and out["user_sim/127.0.0.1:1/failures_timeout"] == 1
    assert out["user_sim/retries"] == 2 and out["user_sim/failovers"] == 1 and out["user_sim/turns"] == 2
    assert out["user_sim/127.0.0.1:2/latency_p50_s"] == pytest.approx(0.5)
    assert "user_sim/127.0.0.1:1/latency_p50_s" not in out, "no success yet: no latency keys"
    stats.reset()
    out = stats.snapshot()
    assert out["user_sim/requests"] == out["user_sim/retries"] == out["user_sim/127.0.0.1:2/failovers"] == 0
    assert "user_sim/latency_p50_s" not in out


def test_counters_are_consistent_under_concurrent_updates():
    inst = InstanceState("http://127.0.0.1:1", "127.0.0.1:1", None)
    stats = ClientStats([inst])

    def work() -> None:
        for _ in range(2000):
            stats.count_request(inst, "elsewhere")
            stats.count_success(inst, 0.1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    snapshots = [stats.snapshot() for _ in range(50)]
    for t in threads:
        t.join()
    assert all(s["user_sim/127.0.0.1:1/retries"] == s["user_sim/failovers"] for s in snapshots)
    final = stats.snapshot()
    assert final["user_sim/requests"] == final["user_sim/127.0.0.1:1/successes"] == 8000
