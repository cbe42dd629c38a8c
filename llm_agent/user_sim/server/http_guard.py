"""Transport-level limits of the simulator server: a connection cap, a request-header deadline, JSON errors for
malformed HTTP, rate-limited logging and the uvicorn launch that uses them.

uvicorn alone keeps a connection that sends a partial request open forever and answers malformed HTTP with a
plain-text 400; :func:`guarded_protocol` builds an h11 protocol class that, over the connection cap, closes the
connection that has waited longest for the client: without sending a request's headers, or sending its body
(a slow client, idle or hostile: a chat request arrives in milliseconds; a request being answered is never
closed), or refuses the new one with a JSON 503 when every connection is busy, so clients that reconnect as fast
as they are shed cannot keep `/health` out. It answers a connection whose request headers are not complete `header_timeout_s` after it
opened (or after its previous response) with a JSON 408 and closes it, and sends malformed-HTTP 400s as
OpenAI-shaped JSON. The body deadline and the in-flight cap live in the app (`server.py`). :class:`RateLimitFilter` keeps a flood
of identical warnings (e.g. asyncio's failed accepts) from filling the disk.
"""
from __future__ import annotations

import asyncio
import json
import logging
import resource
import threading
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


def json_error_bytes(status: int, reason: str, message: str, code: str) -> bytes:
    """A complete HTTP/1.1 response (Connection: close) with an OpenAI-shaped JSON error body."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode()
    return head + body


def guarded_protocol(max_connections: int, header_timeout_s: float) -> type[H11Protocol]:
    """An H11Protocol subclass enforcing `max_connections` open connections and the request-header deadline."""

    class GuardedH11Protocol(H11Protocol):
        """uvicorn's h11 protocol with a connection cap, a header deadline and JSON 400s (see module docstring)."""

        _header_timer: asyncio.TimerHandle | None = None
        _idle_since = 0.0
        _body_since: float | None = None  # when the current request's headers arrived, while its body arrives

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._idle_since = time.monotonic()
            self._arm_header_timer()
            if len(self.connections) > max_connections:
                self._shed()

        def _waiting_for_client_since(self) -> float | None:
            """Since when this connection waits for its client: for a request's headers (idle or partial) or for
            the rest of its body; None while a request is being answered or the connection is closing."""
            if self.transport.is_closing():
                return None
            if self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete):
                return self._idle_since
            if self.conn.their_state is h11.SEND_BODY:
                return self._body_since
            return None

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is h11.SEND_BODY:
                if self._body_since is None:
                    self._body_since = time.monotonic()
            else:
                self._body_since = None

        def _shed(self) -> None:
            """Over the cap: close the connection that has waited longest for its client (headers or body), else
            refuse this new one with a JSON 503."""
            waiting = [(since, c) for c in self.connections if isinstance(c, GuardedH11Protocol)
                       and (since := c._waiting_for_client_since()) is not None]
            oldest = min(waiting, key=lambda pair: pair[0], default=(None, None))[1]
            if oldest is not None and oldest is not self:
                logger.warning("connection cap of %d reached: closing the connection that waited longest for its "
                               "client", max_connections)
                oldest.transport.close()
                return
            logger.warning("connection cap of %d reached: refusing a new connection", max_connections)
            self.transport.write(json_error_bytes(503, "Service Unavailable", "too many open connections",
                                                  "overloaded"))
            self.transport.close()

        def _arm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_deadline)

        def _header_deadline(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return  # closed already, or the request's headers arrived (the body has its own deadline)
            if self.conn.our_state is h11.IDLE:
                msg = f"request headers not received within {header_timeout_s:g} s"
                self.transport.write(json_error_bytes(408, "Request Timeout", msg, "request_timeout"))
            self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._idle_since = time.monotonic()
            if not self.transport.is_closing():
                self._arm_header_timer()  # the next request on this keep-alive connection gets its own deadline

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            self.transport.write(json_error_bytes(400, "Bad Request", f"malformed HTTP request: {msg}",
                                                 "invalid_http"))
            self.transport.close()

    return GuardedH11Protocol


class RateLimitFilter(logging.Filter):
    """Lets through at most `burst` records per message template every `interval_s` seconds; the first dropped
    record of an interval is followed, once the interval ends, by a count of what was suppressed."""

    def __init__(self, burst: int = 5, interval_s: float = 10.0) -> None:
        super().__init__()
        self.burst, self.interval_s = burst, interval_s
        self._lock = threading.Lock()
        self._windows: dict[str, list[float]] = {}  # template -> [window start, passed, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        """True when `record` may be emitted (see the class docstring)."""
        now = time.monotonic()
        key = f"{record.name}:{record.msg}"
        with self._lock:
            window = self._windows.get(key)
            if window is None or now - window[0] >= self.interval_s:
                dropped = 0 if window is None else int(window[2])
                self._windows[key] = [now, 1, 0]
                if len(self._windows) > 1000:
                    self._windows = {key: self._windows[key]}
                if dropped:
                    record.msg = f"{record.msg} [{dropped} similar record(s) suppressed in the last interval]"
                return True
            if window[1] < self.burst:
                window[1] += 1
                return True
            window[2] += 1
            return False


def install_log_limits() -> None:
    """Attach a RateLimitFilter to the loggers that can flood under attack (asyncio, uvicorn, this package)."""
    for name in ("asyncio", "uvicorn.error", "uvicorn.access", "llm_agent.user_sim.server.app", __name__):
        log = logging.getLogger(name)
        if not any(isinstance(f, RateLimitFilter) for f in log.filters):
            log.addFilter(RateLimitFilter())


def usable_connection_cap(requested: int, reserve: int = 64) -> int:
    """`requested`, lowered to fit the open-file limit (raised to its hard maximum first) minus `reserve`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return requested
    return max(1, min(requested, soft - reserve))
