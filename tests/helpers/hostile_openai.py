"""Test helper: an OpenAI-compatible server on loopback whose answers are hostile (they trickle, flood, nest
deeply, carry lone surrogates, shed load slowly, or are fine), to check every client of such endpoints. A request
with `"stream": true` gets Server-Sent Events of chat.completion.chunk: well-formed ones in mode "ok" (the
content in `pieces`, optionally held after some of them until the test lets go), hostile ones in the "sse_*"
modes."""
from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SSE_MODES = ("sse_trickle", "sse_flood", "sse_garbage", "sse_nested", "sse_no_done", "sse_no_finish", "sse_stall",
             "sse_error")
MODES = ("ok", "trickle", "flood", "nested", "nested_503", "nested_post", "surrogate", "stall", "overloaded_slow",
         "raw", *SSE_MODES)
SLOW_S = 0.9  # how long an "overloaded_slow" answer takes
FLOOD_BYTES = 50 << 20


def completion(content: str) -> bytes:
    """A chat-completion body with `content` (JSON-escaped, so lone surrogates travel as \\udXXX escapes)."""
    return json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                    "finish_reason": "stop"}]}).encode()


def chunk_event(content: str | None = None, finish: str | None = None) -> bytes:
    """One `data:` event of a chat.completion.chunk with a content piece and/or a finish_reason."""
    delta = {} if content is None else {"content": content}
    body = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def split_words(content: str) -> list[str]:
    """`content` in pieces of a word and the spaces after it."""
    return re.findall(r"\s*\S+\s*", content) or [content]


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
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.requests += 1
        if not self._authorized():
            return
        try:
            streamed = json.loads(body).get("stream") is True
        except (ValueError, AttributeError, RecursionError):
            streamed = False
        self.server.streamed += streamed
        mode = self.server.mode
        if streamed and (mode == "ok" or mode in SSE_MODES):
            try:
                self._stream(mode)
            except (BrokenPipeError, ConnectionResetError):
                pass
        else:
            self._answer(completion(self.server.content))

    def _write(self, data: bytes) -> None:
        self.wfile.write(data)
        self.wfile.flush()

    def _stream(self, mode: str) -> None:
        """Server-Sent Events of the content's pieces (the connection closes at the end: HTTP/1.0)."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        pieces = self.server.pieces or split_words(self.server.content)
        events = [chunk_event(p) for p in pieces] + [chunk_event(finish="stop"), b"data: [DONE]\n\n"]
        if mode == "sse_trickle":  # a valid stream, one byte every 0.1 s
            for byte in b"".join(events):
                self._write(bytes([byte]))
                if self.server.stopping.wait(0.1):
                    return
        elif mode == "sse_flood":  # valid events without end
            event = chunk_event("x" * (1 << 16))
            for _ in range((64 << 20) // len(event)):
                self.wfile.write(event)
        elif mode == "sse_stall":  # one piece, then nothing
            self._write(events[0])
            self.server.stopping.wait(60)
        elif mode in ("sse_garbage", "sse_nested", "sse_error"):
            bad = {"sse_garbage": b"data: {not json at all\n\n",
                   "sse_nested": b"data: " + b"[" * 200_000 + b"]" * 200_000 + b"\n\n",
                   "sse_error": b'data: {"error": {"message": "model crashed"}}\n\n'}[mode]
            self._write(events[0] + bad + b"".join(events[1:]))
        elif mode == "sse_no_done":
            self._write(b"".join(events[:-1]))
        elif mode == "sse_no_finish":
            self._write(b"".join(events[:-2]) + events[-1])
        else:
            hold, gate = self.server.hold
            for i, event in enumerate(events):
                if i == hold and gate is not None:
                    self.server.held.set()
                    gate.wait(60)
                self._write(event)

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
        self.server.pieces, self.server.streamed = None, 0
        self.server.hold, self.server.held = (0, None), threading.Event()
        self.server.stopping = threading.Event()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        # a short poll: shutdown() waits for the serving loop to look at its flag (0.5 s by default)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    def answer_with(self, status: int, body: bytes) -> None:
        """In mode "raw", answer every request from now on with `status` and `body`."""
        self.server.raw = (status, body)

    def stream_in(self, pieces: list[str], hold: int = 0, gate: threading.Event | None = None) -> None:
        """Stream the content as `pieces` from now on; with `gate`, each stream stops after `hold` pieces until
        the gate is set (`held` is set when a stream gets there)."""
        self.server.pieces, self.server.hold = list(pieces), (hold, gate)

    @property
    def held(self) -> threading.Event:
        """Set once a stream waits at its gate."""
        return self.server.held

    @property
    def streamed(self) -> int:
        """POST requests received that asked for a stream."""
        return self.server.streamed

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
