"""Calls to an OpenAI-compatible HTTP endpoint (an LLM that writes profiles, a hosted agent): one request with a
total deadline, a cap on the reply's size read as it streams in, and the reply decoded by the project's policy
for outside input (`verl.utils.untrusted`).

A request ends, one way or the other, within about `timeout_s`: the deadline is checked after every chunk of
the reply, and no single wait for the server (connect, or the next chunk) is longer than `timeout_s`, so a
reply trickled a byte at a time stops at the deadline and a silent server within twice `timeout_s` at worst.
`chat_stream` holds a streamed completion (Server-Sent Events of chat.completion.chunk) to the same limits: the
deadline and the size cap count the whole stream, each event is decoded by the same policy, and a stream must
end with a finish_reason and `data: [DONE]`.
"""
from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from verl.utils.untrusted import UntrustedInputError, clean_text, load_json

__all__ = ["EndpointError", "MAX_REPLY_BYTES", "OpenAIEndpoint", "StreamedChat"]

MAX_REPLY_BYTES = 8 << 20  # a chat completion is a few KB; a reply larger than this is refused, not buffered


class EndpointError(Exception):
    """One failed request; `kind` is connection | timeout | http (5xx, 408, 429: worth retrying) | rejected
    (another 4xx: the request itself is wrong) | too_large | garbage (not the expected JSON)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


class OpenAIEndpoint:
    """`served_models()` and `chat(body)` against `base_url` (with or without the `/v1` suffix). The API key is
    sent as a bearer token and never appears in an error message."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 60.0,
                 max_reply_bytes: int = MAX_REPLY_BYTES) -> None:
        url = base_url.strip().rstrip("/")
        self.base = url if url.endswith("/v1") else url + "/v1"
        self.timeout_s, self.max_reply_bytes = float(timeout_s), int(max_reply_bytes)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(headers=headers, timeout=self.timeout_s, trust_env=False)

    def _request(self, method: str, path: str, body: Any = None) -> Any:
        """The decoded JSON body of a 200 reply to `method path`; EndpointError otherwise."""
        url = self.base + path
        deadline = time.monotonic() + self.timeout_s
        with self._errors(method, url):
            with self._client.stream(method, url, json=body) as response:
                raw = b"".join(self._chunks(response, f"{method} {url}", deadline))
                status = response.status_code
        return self._decode(status, raw, f"{method} {url}")

    def _chunks(self, response: httpx.Response, what: str, deadline: float) -> Iterator[bytes]:
        """The reply's bytes as they come; EndpointError past the size cap or the deadline."""
        size = 0
        for chunk in response.iter_bytes():
            size += len(chunk)
            if size > self.max_reply_bytes:
                raise EndpointError("too_large", f"{what}: reply over {self.max_reply_bytes} bytes")
            yield chunk
            if time.monotonic() > deadline:
                raise EndpointError("timeout", f"{what}: reply not complete after {self.timeout_s:g}s "
                                               f"({size} bytes so far)")

    @staticmethod
    @contextlib.contextmanager
    def _errors(method: str, url: str) -> Iterator[None]:
        """httpx's timeouts and connection failures as EndpointError."""
        try:
            yield
        except httpx.TimeoutException as exc:
            raise EndpointError("timeout", f"{method} {url}: {type(exc).__name__}") from None
        except httpx.HTTPError as exc:
            raise EndpointError("connection", f"{method} {url}: {type(exc).__name__}: {clean_text(str(exc))[:200]}"
                                ) from None

    def _decode(self, status: int, raw: bytes, what: str) -> Any:
        """The JSON of a 200 reply; EndpointError for another status or a body that is not JSON."""
        if status != 200:
            retryable = status >= 500 or status in (408, 429)
            text = clean_text(raw[:200].decode("utf-8", "replace"))
            raise EndpointError("http" if retryable else "rejected", f"{what}: HTTP {status}: {text!r}")
        try:
            return load_json(raw, what=f"{what} reply", max_bytes=self.max_reply_bytes)
        except UntrustedInputError as exc:
            raise EndpointError("garbage", str(exc)) from None

    def served_models(self) -> list[str]:
        """The model ids of `GET /v1/models`; EndpointError('garbage') when the reply lists none."""
        body = self._request("GET", "/models")
        data = body.get("data") if isinstance(body, dict) else None
        ids = [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)] if isinstance(
            data, list) else []
        if not ids:
            raise EndpointError("garbage", f"GET {self.base}/models: the reply lists no model")
        return ids

    def chat(self, body: dict[str, Any]) -> tuple[str, str]:
        """(content, finish_reason) of the first choice of `POST /v1/chat/completions` with `body`."""
        return self._completion(self._request("POST", "/chat/completions", body))

    def _completion(self, reply: Any) -> tuple[str, str]:
        """(content, finish_reason) of a decoded chat completion; EndpointError('garbage') when it is not one."""
        try:
            choice = reply["choices"][0]
            content, finish = choice["message"]["content"], choice.get("finish_reason") or "stop"
        except (KeyError, IndexError, TypeError) as exc:
            raise EndpointError("garbage", f"POST {self.base}/chat/completions: not a chat completion "
                                           f"(missing {exc!r})") from None
        if content is None:
            content = ""
        if not isinstance(content, str) or not isinstance(finish, str):
            raise EndpointError("garbage", f"POST {self.base}/chat/completions: message content is a "
                                           f"{type(content).__name__}, not text")
        return content, finish

    def chat_stream(self, body: dict[str, Any], on_text: Callable[[str], None]) -> tuple[str, str]:
        """`chat(body)` streamed (`"stream": true`): `on_text` gets each piece of the content as it comes; the
        (content, finish_reason) returned are what `chat` returns for the same content. A server that answers
        with one JSON completion instead is read as `chat` reads it (its content one piece)."""
        url = self.base + "/chat/completions"
        what = f"POST {url}"
        deadline = time.monotonic() + self.timeout_s
        with self._errors("POST", url):
            with self._client.stream("POST", url, json={**body, "stream": True}) as response:
                chunks = self._chunks(response, what, deadline)
                if response.status_code == 200 and response.headers.get("content-type", "").startswith(
                        "text/event-stream"):
                    stream = StreamedChat(what, self.max_reply_bytes, on_text)
                    for chunk in chunks:
                        if stream.feed(chunk):
                            break
                    return stream.result()
                raw = b"".join(chunks)
                status = response.status_code
        content, finish = self._completion(self._decode(status, raw, what))
        if content:
            on_text(content)
        return content, finish

    def close(self) -> None:
        """Close the connections."""
        self._client.close()


class StreamedChat:
    """The events of one streamed chat completion, fed as bytes: each chunk's content piece goes to `on_text`
    (cleaned, a surrogate pair split between pieces kept whole); `result()` is (content, finish_reason), or
    EndpointError when the stream broke the protocol: an event that is not a chat.completion.chunk, an error
    event, no finish_reason or no `data: [DONE]`."""

    def __init__(self, what: str, max_bytes: int, on_text: Callable[[str], None]) -> None:
        self.what, self.max_bytes, self.on_text = what, max_bytes, on_text
        self.line: list[bytes] = []  # the line being read, in pieces
        self.data: list[bytes] = []  # the data lines of the event being read
        self.pieces: list[str] = []
        self.held = ""  # a high surrogate waiting for its pair
        self.finish: str | None = None
        self.done = False

    def feed(self, chunk: bytes) -> bool:
        """Read `chunk`; True once `data: [DONE]` came (nothing after it is read)."""
        *complete, rest = chunk.split(b"\n")
        for part in complete:
            self.line.append(part)
            line, self.line = b"".join(self.line).rstrip(b"\r"), []
            if self._line(line):
                return True
        if rest:
            self.line.append(rest)
        return False

    def _line(self, line: bytes) -> bool:
        if not line:  # an empty line ends an event
            return self._event()
        if line.startswith(b"data:"):
            value = line[5:]
            self.data.append(value[1:] if value.startswith(b" ") else value)
        return False  # comments (keep-alives), event names, ids and retry hints carry no text

    def _event(self) -> bool:
        if not self.data:
            return False
        data, self.data = b"\n".join(self.data), []
        if data.strip() == b"[DONE]":
            self.done = True
            return True
        try:
            event = load_json(data, what=f"{self.what} stream event", max_bytes=self.max_bytes, clean=False)
        except UntrustedInputError as exc:
            raise EndpointError("garbage", str(exc)) from None
        if isinstance(event, dict) and "error" in event:
            detail = clean_text(json.dumps(event["error"])[:200])
            raise EndpointError("http", f"{self.what}: the stream reported an error: {detail}")
        choices = event.get("choices") if isinstance(event, dict) else None
        if not isinstance(choices, list):
            raise EndpointError("garbage", f"{self.what}: a stream event is not a chat.completion.chunk")
        if not choices:  # a usage event
            return False
        choice = choices[0]
        delta = choice.get("delta") if isinstance(choice, dict) else None
        content = delta.get("content") if isinstance(delta, dict) else None
        finish = choice.get("finish_reason") if isinstance(choice, dict) else None
        if not isinstance(delta, dict) or not isinstance(content, (str, type(None))) or not isinstance(
                finish, (str, type(None))):
            raise EndpointError("garbage", f"{self.what}: a stream event's choice has no delta text")
        if content:
            self.pieces.append(content)
            self._hand_on(content)
        if finish:
            self.finish = finish
        return False

    def _hand_on(self, piece: str) -> None:
        text = self.held + piece
        self.held = text[-1] if "\ud800" <= text[-1] <= "\udbff" else ""
        text = text[:len(text) - len(self.held)]
        if text:
            self.on_text(clean_text(_paired(text)))

    def result(self) -> tuple[str, str]:
        """(content, finish_reason) of a complete stream; EndpointError for an incomplete one."""
        if self.line:
            self._line(b"".join(self.line).rstrip(b"\r"))
            self.line = []
        if not self.done:
            self._event()  # an event the stream ended in without its blank line
        if not self.done:
            raise EndpointError("connection", f"{self.what}: the stream ended without data: [DONE] "
                                              f"({len(self.pieces)} pieces of text so far)")
        if self.finish is None:
            raise EndpointError("garbage", f"{self.what}: the stream ended without a finish_reason")
        if self.held:
            self.on_text(clean_text(self.held))
            self.held = ""
        return clean_text(_paired("".join(self.pieces))), self.finish


def _paired(text: str) -> str:
    """`text` with each high/low surrogate pair (a character JSON escaped as two, split between events) joined."""
    if text.isascii():
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")
