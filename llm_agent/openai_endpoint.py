"""Calls to an OpenAI-compatible HTTP endpoint (an LLM that writes profiles, a hosted agent): one request with a
total deadline, a cap on the reply's size read as it streams in, and the reply decoded by the project's policy
for outside input (`verl.utils.untrusted`).

A request ends, one way or the other, within about `timeout_s`: the deadline is checked after every chunk of
the reply, and no single wait for the server (connect, or the next chunk) is longer than `timeout_s`, so a
reply trickled a byte at a time stops at the deadline and a silent server within twice `timeout_s` at worst.
"""
from __future__ import annotations

import time
from typing import Any

import httpx

from verl.utils.untrusted import UntrustedInputError, clean_text, load_json

__all__ = ["EndpointError", "MAX_REPLY_BYTES", "OpenAIEndpoint"]

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
        try:
            with self._client.stream(method, url, json=body) as response:
                chunks, size = [], 0
                for chunk in response.iter_bytes():
                    size += len(chunk)
                    if size > self.max_reply_bytes:
                        raise EndpointError("too_large", f"{method} {url}: reply over {self.max_reply_bytes} bytes")
                    chunks.append(chunk)
                    if time.monotonic() > deadline:
                        raise EndpointError("timeout", f"{method} {url}: reply not complete after {self.timeout_s:g}s "
                                                       f"({size} bytes so far)")
                status = response.status_code
        except httpx.TimeoutException as exc:
            raise EndpointError("timeout", f"{method} {url}: {type(exc).__name__}") from None
        except httpx.HTTPError as exc:
            raise EndpointError("connection", f"{method} {url}: {type(exc).__name__}: {clean_text(str(exc))[:200]}"
                                ) from None
        raw = b"".join(chunks)
        if status != 200:
            retryable = status >= 500 or status in (408, 429)
            text = clean_text(raw[:200].decode("utf-8", "replace"))
            raise EndpointError("http" if retryable else "rejected", f"{method} {url}: HTTP {status}: {text!r}")
        try:
            return load_json(raw, what=f"{method} {url} reply", max_bytes=self.max_reply_bytes)
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
        reply = self._request("POST", "/chat/completions", body)
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

    def close(self) -> None:
        """Close the connections."""
        self._client.close()
