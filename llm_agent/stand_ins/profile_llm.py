"""A scripted OpenAI-compatible endpoint for the profile writer: a real HTTP server on 127.0.0.1.

`ScriptedProfileLLM(mode)` serves `POST /v1/chat/completions` (and `GET /v1/models`). It reads the request the
profile writer sends (`llm_agent.profiles.answers.profile_request`: the state lines and the numbered library)
and answers per `mode`:

- `good`: valid JSON with the state unchanged and 1-3 library numbers, chosen by a keyword judgement of the
  behaviour texts (distrustful phrases avoided for trusting users, action phrases for unwilling ones, grievances
  for happy trusting ones). It is not the rule table, so some answers still break a rule, as a real model's do;
- `bad`: cycles through faulty answers: not JSON, changed scores, invented behaviours, a near-verbatim text in a
  code fence (repairable), too many and repeated numbers;
- `mixed`: `bad` for a `bad_share` of the requests (by request seed), `good` otherwise;
- `error`: HTTP 500; `silent`: holds the request without answering (the client times out).

`delay_s` delays every answer. `requests` counts the chat requests served. `start()` serves and returns the
base URL (also `url`); `stop()` ends.
"""
from __future__ import annotations

import json
import random
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["BAD_KINDS", "MODES", "ScriptedProfileLLM"]

MODES = ("good", "bad", "mixed", "error", "silent")
BAD_KINDS = ("not_json", "changed_scores", "invented", "fenced_near_text", "too_many_repeated")
_STATE_LINE = re.compile(r"^- ([a-z][a-z0-9_]*): (-?\d+) on a scale from (-?\d+) to (-?\d+)", re.M)
_LIBRARY_LINE = re.compile(r"^(\d+)\. \[([a-z_]+)\] (.+)$", re.M)
_AVOID = {  # (dimension, level test) -> phrases such a user would not show
    "distrust": ("scam", "trick", "trust", "catch", "suspect", "genuine", "doubt", "guarded", "paid per"),
    "action": ("right away", "press", "button", "negotiate", "joke", "bigger", "promise", "tapping", "rushes"),
    "grievance": ("annoyed", "no new orders", "lost money", "never followed"),
}


def _levels(prompt: str) -> dict[str, float]:
    return {dim: (int(v) - int(lo)) / max(1, int(hi) - int(lo)) for dim, v, lo, hi in _STATE_LINE.findall(prompt)}


def good_answer(prompt: str, seed: int) -> dict[str, Any]:
    """The `good` mode's answer object for a profile request (see the module docstring)."""
    state = {dim: int(v) for dim, v, _, _ in _STATE_LINE.findall(prompt)}
    levels = _levels(prompt)
    avoid: list[str] = []
    if levels.get("trust", 0) >= 0.6:
        avoid += _AVOID["distrust"]
    if levels.get("cooperation", 1) <= 0.25:
        avoid += _AVOID["action"]
    if levels.get("trust", 0) >= 0.6 and levels.get("emotion", 0) >= 0.6:
        avoid += _AVOID["grievance"]
    library = [(int(n), text) for n, _, text in _LIBRARY_LINE.findall(prompt)]
    fitting = [n for n, text in library if not any(p in text.lower() for p in avoid)] or [n for n, _ in library]
    rng = random.Random(seed)
    return {**state, "behaviors": rng.sample(fitting, min(len(fitting), rng.randint(1, 3)))}


def bad_answer(prompt: str, seed: int) -> str:
    """A faulty answer of kind BAD_KINDS[seed % len(BAD_KINDS)] for a profile request."""
    kind = BAD_KINDS[seed % len(BAD_KINDS)]
    good = good_answer(prompt, seed)
    library = {int(n): text for n, _, text in _LIBRARY_LINE.findall(prompt)}
    if kind == "not_json":
        return "Sure! This customer would probably ask about costs and be a bit sceptical."
    if kind == "changed_scores":
        return json.dumps({**good, "trust": good.get("trust", 0) + 1})
    if kind == "invented":
        return json.dumps({**good, "behaviors": ["Sings the national anthem before answering.",
                                                 "Asks the caller to order a pizza for them."]})
    if kind == "fenced_near_text":
        text = library[good["behaviors"][0]]
        return "```json\n" + json.dumps({**good, "behaviors": [text.lower().rstrip(".") + "!"]}) + "\n```"
    return json.dumps({**good, "behaviors": good["behaviors"] * 2 + list(library)[:4]})


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"

    def log_message(self, *args: Any) -> None:  # quiet: tests and benches read counts, not access logs
        pass

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timed out or was killed)
            pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path.rstrip("/") == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": self.server.owner.model, "object": "model"}]})
        else:
            self._send(404, {"error": f"no route {self.path}"})

    def do_POST(self) -> None:  # noqa: N802
        if self.path.rstrip("/") != "/v1/chat/completions":
            self._send(404, {"error": f"no route {self.path}"})
            return
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        owner = self.server.owner
        content = owner.answer(request)
        if content is None:
            return
        self._send(200, {"id": "scripted", "object": "chat.completion", "model": owner.model,
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                      "finish_reason": "stop"}]})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: "ScriptedProfileLLM"


class ScriptedProfileLLM:
    """The scripted endpoint of the module docstring."""

    def __init__(self, mode: str = "good", bad_share: float = 0.3, model: str = "scripted-profile-llm",
                 silent_s: float = 30.0, delay_s: float = 0.0) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode, self.bad_share, self.model, self.silent_s = mode, bad_share, model, silent_s
        self.delay_s = delay_s
        self.requests = 0
        self._lock = threading.Lock()
        self._server: _Server | None = None
        self.url: str | None = None
        self._stop = threading.Event()

    def answer(self, request: dict[str, Any]) -> str | None:
        """The message content for a chat request (None: an HTTP 500 or no answer was sent instead)."""
        with self._lock:
            self.requests += 1
        prompt = "\n".join(m.get("content", "") for m in request.get("messages", []))
        seed = int(request.get("seed") or 0)
        if self.mode == "silent":
            self._stop.wait(self.silent_s)
            return None
        if self.delay_s:
            self._stop.wait(self.delay_s)
        if self.mode == "error":
            raise _HTTPError("scripted internal error")
        bad = self.mode == "bad" or (self.mode == "mixed" and random.Random(seed).random() < self.bad_share)
        return bad_answer(prompt, seed) if bad else json.dumps(good_answer(prompt, seed))

    def start(self) -> str:
        """Serve on a free port of 127.0.0.1 in a background thread; return the base URL (with /v1)."""
        self._server = _Server(("127.0.0.1", 0), _ErrorAwareHandler)
        self._server.owner = self
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"
        return self.url

    def stop(self) -> None:
        """Release held requests and shut the server down."""
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "ScriptedProfileLLM":
        self.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()


class _HTTPError(Exception):
    """Raised by `answer` in mode `error`; the handler turns it into an HTTP 500."""


class _ErrorAwareHandler(_Handler):
    def do_POST(self) -> None:  # noqa: N802
        try:
            super().do_POST()
        except _HTTPError:
            self._send(500, {"error": "scripted internal error"})

