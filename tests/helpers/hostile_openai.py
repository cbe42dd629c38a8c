"""Test helper: an OpenAI-compatible server on loopback whose answers are hostile (they trickle, flood, nest
deeply, carry lone surrogates, shed load slowly, or are fine), to check every client of such endpoints."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODES = ("ok", "trickle", "flood", "nested", "nested_503", "nested_post", "surrogate", "stall", "overloaded_slow",
         "raw")
SLOW_S = 0.9  # how long an "overloaded_slow" answer takes
FLOOD_BYTES = 50 << 20


def completion(content: str) -> bytes:
    """A chat-completion body with `content` (JSON-escaped, so lone surrogates travel as \\udXXX escapes)."""
    return json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                    "finish_reason": "stop"}]}).encode()


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"

    def log_message(self, *args) -> None:  # keep test output quiet
        pass

    def _send(self, status: int, body: bytes, length: int | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)

    def _authorized(self) -> bool:
        key = self.server.api_key
        if key is None or self.headers.get("Authorization") == f"Bearer {key}":
            return True
        self._send(401, json.dumps({"error": {"message": "invalid API key", "code": "invalid_api_key"}}).encode())
        return False

    def do_GET(self) -> None:
        if self._authorized():
            self._answer(json.dumps({"data": [{"id": "m"}]}).encode())

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.requests += 1
        if self._authorized():
            self._answer(completion(self.server.content))

    def _answer(self, good: bytes) -> None:
        mode = self.server.mode
        try:
            if mode == "trickle":  # a valid body, one byte every 0.1 s
                self._send(200, b"", length=len(good))
                for i in range(len(good)):
                    self.wfile.write(good[i:i + 1])
                    self.wfile.flush()
                    if self.server.stopping.wait(0.1):
                        return
            elif mode == "stall":  # headers, then nothing
                self._send(200, b"", length=len(good))
                self.server.stopping.wait(60)
            elif mode == "flood":
                self._send(200, b"", length=FLOOD_BYTES)
                chunk = b"x" * (1 << 20)
                for _ in range(FLOOD_BYTES // len(chunk)):
                    self.wfile.write(chunk)
            elif mode == "nested_post" and self.command == "POST":  # healthy at start-up, hostile afterwards
                self._send(200, b"[" * 200_000 + b"]" * 200_000)
            elif mode in ("nested", "nested_503"):
                self._send(200 if mode == "nested" else 503, b"[" * 200_000 + b"]" * 200_000)
            elif mode == "overloaded_slow" and self.command == "POST":  # a saturated server, slow to say so
                self.server.stopping.wait(SLOW_S)
                self._send(503, json.dumps({"error": {"message": "busy", "type": "server_error",
                                                      "code": "overloaded"}}).encode())
            elif mode == "raw":  # whatever status and body the test set last (`HostileOpenAIServer.answer_with`)
                self._send(*self.server.raw)
            elif mode == "surrogate":
                self._send(200, completion("hello \ud800 there") if self.command == "POST" else good)
            else:
                self._send(200, good)
        except (BrokenPipeError, ConnectionResetError):
            pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True


class HostileOpenAIServer:
    """`with HostileOpenAIServer(mode) as s:` serves on `s.url` (127.0.0.1, a free port) until the block ends;
    a well-formed answer's text is `content`; with `api_key`, a request without that bearer token gets a 401."""

    def __init__(self, mode: str, content: str = "ok", api_key: str | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.server = _Server(("127.0.0.1", 0), _Handler)
        self.server.mode, self.server.content, self.server.requests = mode, content, 0
        self.server.api_key = api_key
        self.server.raw = (200, completion(content))
        self.server.stopping = threading.Event()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        # a short poll: shutdown() waits for the serving loop to look at its flag (0.5 s by default)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    def answer_with(self, status: int, body: bytes) -> None:
        """In mode "raw", answer every request from now on with `status` and `body`."""
        self.server.raw = (status, body)

    @property
    def requests(self) -> int:
        """POST requests received so far."""
        return self.server.requests

    def __enter__(self) -> "HostileOpenAIServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.stopping.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def timed(fn, *args, **kwargs):
    """(result or raised exception, seconds taken)."""
    start = time.monotonic()
    try:
        result = fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        result = exc
    return result, time.monotonic() - start
