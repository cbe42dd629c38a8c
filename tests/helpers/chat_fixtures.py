"""The chat page's server on loopback with the scripted agent, built by for_evaluation.chat's own construction, and
a small HTTP client for it."""
from __future__ import annotations

import contextlib
import http.client
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from for_evaluation.chat import build_server, parse_args


@contextlib.contextmanager
def running_chat(tokenizer_dir: str, out: Path, *extra: str, agent: str = "scripted:good") -> Iterator[Any]:
    """A ChatServer for `agent` (default `scripted:good`) serving on a thread until the block ends."""
    args = parse_args(["--agent", agent, "--tokenizer", tokenizer_dir, "--out", str(out),
                       "--max-turns", "12", "--log-level", "WARNING", *extra])
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    server, owned = build_server(args, work)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        for thing in owned:
            thing.close()
        thread.join(10)


def request(server: Any, method: str, path: str, body: Any = None, token: str | None = "server",
            raw: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """(status, decoded JSON or text) of one request; `token="server"` sends the server's token as the header."""
    parts = urlsplit(server.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    sent = dict(headers or {})
    if token == "server":
        sent["X-Chat-Token"] = server.token
    elif token is not None:
        sent["X-Chat-Token"] = token
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    if data is not None:
        sent.setdefault("Content-Type", "application/json")
    try:
        conn.request(method, path, body=data, headers=sent)
        response = conn.getresponse()
        payload = response.read()
        kind = response.getheader("Content-Type", "")
    finally:
        conn.close()
    return response.status, json.loads(payload) if kind.startswith("application/json") else payload.decode()


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a file."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


PER_CALL = {"uid", "dialogue_id", "wall_s"}  # what differs between two calls of the same agent and profile


def same_part(line: dict[str, Any]) -> dict[str, Any]:
    """A record without what differs per call (and the server's own prompt file's place)."""
    settings = {k: v for k, v in line["settings"].items() if k != "test_file"}
    return {**{k: v for k, v in line.items() if k not in PER_CALL}, "settings": settings}
