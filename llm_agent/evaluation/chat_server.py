"""The local page where a person talks to an agent: a small threaded HTTP server over `HumanCall`.

Every request must carry the access token (`?token=` or the `X-Chat-Token` header), else 403. Request bodies are
JSON objects of at most `MAX_BODY_BYTES` (413 beyond, 411 without a length) decoded by the project's policy for
outside input (`verl.utils.untrusted.load_json`, nesting capped at `MAX_DEPTH`: 400). Each request is served on
its own thread and the agent generates on the call's thread, so `/health` answers while the agent works.

    GET  /?token=T        the page (chat.html)
    GET  /health          {"ok": true}
    GET  /api/scenario    dimensions and ranges, the behaviour library, the agent's name
    GET  /api/call        the current call (HumanCall.snapshot) or {"phase": "none"}
    GET  /api/stream      Server-Sent Events of the current call's progress ({version, phase, agent_turns, partial}:
                          the agent's turn so far where the engine streams) until its next turn is done or it ends
    POST /api/call        {"profile": "sample" | {"state": {dim: int}, "behaviors": [library index, ...]}}
    POST /api/turn        {"reply": str, "state": {dim: int}, "end": null | "agreed" | "hung_up"}
    POST /api/abandon     stop the current call (no record)
"""
from __future__ import annotations

import hmac
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlsplit

from llm_agent.evaluation.human_calls import HumanCall, PersonTurn
from llm_agent.scenario import Scenario, UserProfile
from verl.utils.untrusted import load_json

logger = logging.getLogger(__name__)

__all__ = ["ChatServer", "MAX_BODY_BYTES"]

MAX_BODY_BYTES = 16 << 10
MAX_DEPTH = 4
WAIT_S = 300.0  # how long a POST waits for the agent's next turn before answering with the call as it is
TOKEN_HEADER = "X-Chat-Token"


class HttpError(Exception):
    """An error answered as JSON {"error": message} with `status`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ChatServer:
    """The page's server: one call at a time, started by `start_call(profile)`; `sample()` draws a profile."""

    def __init__(self, scenario: Scenario, start_call: Callable[[UserProfile], HumanCall],
                 sample: Callable[[], UserProfile], agent_name: str, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None) -> None:
        self.scenario, self.start_call, self.sample, self.agent_name = scenario, start_call, sample, agent_name
        self.token = token or secrets.token_urlsafe(24)
        self.call: HumanCall | None = None
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer((host, port), _handler(self))
        self.httpd.daemon_threads = True

    @property
    def url(self) -> str:
        """The page's address with its token."""
        host, port = self.httpd.server_address[:2]
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}/?token={self.token}"

    def serve_forever(self) -> None:
        """Serve until `shutdown`."""
        self.httpd.serve_forever(poll_interval=0.2)

    def shutdown(self) -> None:
        """Stop serving and abandon a call in progress."""
        self.httpd.shutdown()
        self.httpd.server_close()
        if self.call is not None and self.call.phase in ("agent", "user"):
            self.call.abandon()

    def scenario_info(self) -> dict[str, Any]:
        """What the page's controls need of the scenario."""
        s = self.scenario
        return {"name": s.name, "agent": self.agent_name,
                "dims": [{"name": d, "min": s.state_ranges[d].min, "max": s.state_ranges[d].max} for d in s.dims],
                "behaviors": [b.to_dict() for b in s.behaviors]}

    def new_call(self, body: dict[str, Any]) -> HumanCall:
        """Abandon the current call (if any) and start one with the body's profile."""
        choice = body.get("profile", "sample")
        if choice == "sample":
            profile = self.sample()
        elif isinstance(choice, dict) and isinstance(choice.get("behaviors", []), list):
            library = self.scenario.behaviors
            picks = choice.get("behaviors", [])
            if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(library) for i in picks):
                raise HttpError(400, f"behaviors must be indices into the library (0..{len(library) - 1})")
            try:
                profile = UserProfile(choice.get("state"), tuple(library[i] for i in dict.fromkeys(picks)))
                self.scenario.check_profile(profile)
            except ValueError as exc:
                raise HttpError(400, f"profile: {exc}") from None
        else:
            raise HttpError(400, 'profile must be "sample" or {"state": {...}, "behaviors": [...]}')
        with self.lock:
            old = self.call
            if old is not None and old.phase in ("agent", "user"):
                old.abandon()
            if old is not None:  # one call on the agent at a time: the old one ends after its current turn
                old.thread.join(WAIT_S)
                if old.thread.is_alive():
                    raise HttpError(503, "the previous call is still generating; try again")
            self.call = self.start_call(profile)
            return self.call


def _handler(server: ChatServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        """One request (see the module docstring)."""

        timeout = 30  # a client that stalls mid-request is dropped
        server_version = "sead-chat"
        sys_version = ""

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
            logger.debug("%s %s", self.address_string(), format % args)

        def _send(self, status: int, body: bytes, content_type: str, extra: dict[str, str] | None = None) -> None:
            self.send_response(status)
            headers = {"Content-Type": content_type, "Content-Length": str(len(body)), "Cache-Control": "no-store",
                       "Referrer-Policy": "no-referrer", "X-Content-Type-Options": "nosniff",
                       "X-Frame-Options": "DENY", **(extra or {})}
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(body)

        def _json(self, status: int, value: Any) -> None:
            self._send(status, json.dumps(value, ensure_ascii=False).encode("utf-8"), "application/json")

        def _authorised(self) -> bool:
            query = parse_qs(urlsplit(self.path).query)
            given = self.headers.get(TOKEN_HEADER) or (query.get("token") or [""])[0]
            return hmac.compare_digest(given.encode("utf-8", "replace"), server.token.encode())

        def _body(self) -> dict[str, Any]:
            if self.headers.get("Transfer-Encoding"):
                raise HttpError(411, "send the body with a Content-Length, not chunked")
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                raise HttpError(411, "a Content-Length header is required")
            if int(length) > MAX_BODY_BYTES:
                self.close_connection = True
                raise HttpError(413, f"the body has {length} bytes, over the limit of {MAX_BODY_BYTES}")
            raw = self.rfile.read(int(length))
            try:
                value = load_json(raw, what="request body", max_bytes=MAX_BODY_BYTES, max_depth=MAX_DEPTH)
            except ValueError as exc:
                raise HttpError(400, str(exc)) from None
            if not isinstance(value, dict):
                raise HttpError(400, "the body must be a JSON object")
            return value

        def _route(self, method: str) -> None:
            if not self._authorised():
                self.close_connection = True
                raise HttpError(403, "a valid access token is required (the URL the server printed)")
            path = urlsplit(self.path).path
            if method == "GET" and path == "/":
                nonce = secrets.token_urlsafe(16)
                page = resources.files("llm_agent.evaluation").joinpath("report_assets", "chat.html")
                csp = (f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; "
                       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
                html = page.read_text(encoding="utf-8").replace("__NONCE__", nonce)
                return self._send(200, html.encode("utf-8"), "text/html; charset=utf-8",
                                  {"Content-Security-Policy": csp})
            if method == "GET" and path == "/health":
                return self._json(200, {"ok": True})
            if method == "GET" and path == "/api/scenario":
                return self._json(200, server.scenario_info())
            if method == "GET" and path == "/api/call":
                return self._json(200, server.call.snapshot() if server.call else {"phase": "none"})
            if method == "GET" and path == "/api/stream":
                return self._stream()
            if method == "POST" and path in ("/api/call", "/api/turn", "/api/abandon"):
                return self._post(path, self._body())
            raise HttpError(404 if path not in ("/", "/health") and not path.startswith("/api/") else 405,
                            f"no {method} {path}")

        def _stream(self) -> None:
            call = server.call
            if call is None:
                raise HttpError(409, "no call: start one first")
            self.send_response(200)
            for key, value in {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-store",
                               "X-Content-Type-Options": "nosniff", "Connection": "close"}.items():
                self.send_header(key, value)
            self.end_headers()
            self.close_connection = True
            deadline, since, first = time.monotonic() + WAIT_S, -1, None
            while (left := deadline - time.monotonic()) > 0:
                event = call.progress(since, left)
                self.wfile.write(f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode("utf-8"))
                self.wfile.flush()
                first = event["agent_turns"] if first is None else first
                if event["phase"] not in ("agent", "user") or event["agent_turns"] > first:
                    return  # the call ended, or the agent's next turn waits for the person
                since = event["version"]

        def _post(self, path: str, body: dict[str, Any]) -> None:
            if path == "/api/call":
                call = server.new_call(body)
                call.wait(0, WAIT_S)
                return self._json(200, call.snapshot())
            call = server.call
            if call is None:
                raise HttpError(409, "no call: start one first")
            if path == "/api/abandon":
                call.abandon()
                return self._json(200, {"phase": "abandoned"})
            unknown = set(body) - {"reply", "state", "end"}
            if unknown:
                raise HttpError(400, f"unknown key(s) {sorted(unknown)}")
            since = call.version
            try:
                call.answer(PersonTurn(reply=body.get("reply"), state=body.get("state"), end=body.get("end")))
            except ValueError as exc:
                raise HttpError(409 if "not waiting" in str(exc) else 400, str(exc)) from None
            call.wait(since + 1, WAIT_S)
            self._json(200, call.snapshot())

        def _serve(self, method: str) -> None:
            try:
                self._route(method)
            except HttpError as exc:
                self._json(exc.status, {"error": str(exc)})
            except Exception:  # a bug must not take the server down; the page gets a 500
                logger.exception("%s %s failed", method, urlsplit(self.path).path)
                self._json(500, {"error": "internal error (see the server's log)"})

        def do_GET(self) -> None:  # noqa: N802 (http.server's names)
            self._serve("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._serve("POST")

    return Handler
