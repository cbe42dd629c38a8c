"""The transport helpers of the simulator server: rate-limited logging, the connection cap, JSON error bytes."""
from __future__ import annotations

import json
import logging
import resource

from llm_agent.user_sim.server.http_guard import RateLimitFilter, json_error_bytes, usable_connection_cap


def _record(msg: str) -> logging.LogRecord:
    return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, None, None)


def test_a_flood_of_identical_records_is_cut_to_a_burst_then_summarised(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr("llm_agent.user_sim.server.http_guard.time.monotonic", lambda: clock[0])
    limiter = RateLimitFilter(burst=5, interval_s=10.0)
    passed = sum(limiter.filter(_record("socket.accept() out of system resource")) for _ in range(10_000))
    assert passed == 5
    assert limiter.filter(_record("another message"))  # other templates have their own budget
    clock[0] = 11.0
    summary = _record("socket.accept() out of system resource")
    assert limiter.filter(summary) and "9995 similar record(s) suppressed" in summary.getMessage()


def test_connection_cap_fits_the_open_file_limit():
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = usable_connection_cap(10 ** 9)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)  # raised to the hard limit by the call
    assert 1 <= cap <= soft - 64 or soft == resource.RLIM_INFINITY
    assert usable_connection_cap(10) == 10


def test_json_error_bytes_is_a_complete_http_response():
    raw = json_error_bytes(408, "Request Timeout", "slow", "request_timeout")
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 Request Timeout") and b"connection: close" in head
    assert int(head.split(b"content-length: ")[1].split(b"\r\n")[0]) == len(body)
    assert json.loads(body)["error"] == {"message": "slow", "type": "invalid_request_error", "param": None,
                                         "code": "request_timeout"}
