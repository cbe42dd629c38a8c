"""The wire side of the simulator client: base-URL parsing, response checks and the errors they raise."""
from __future__ import annotations

from urllib.parse import urlsplit

from llm_agent.user_sim.client.http_pool import HTTPReply

__all__ = ["AttemptError", "SimulatorCheckError", "completion_text", "instance_name", "parse_urls",
           "raise_for_status", "served_model_ids"]


class SimulatorCheckError(RuntimeError):
    """A simulator instance failed the start-up check (unreachable, unhealthy, or not serving the model)."""


class AttemptError(Exception):
    """One failed attempt; `kind` is timeout | connection | http | garbage | rejected | unavailable | deadline |
    overloaded (the server shed the request: HTTP 429, or 503 with code `overloaded`; worth re-sending later)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


def parse_urls(urls: str | list[str]) -> list[str]:
    """Normalise a comma-separated string or a list of base URLs.

    Blank entries (a trailing comma) are skipped; whitespace, trailing '/' and a '/v1' suffix are removed, so
    `http://h:5000/v1/` and `http://h:5000` name the same instance. Raises ValueError naming its position on a URL
    that is repeated or malformed: a scheme other than http(s), no host, a port outside 1-65535, whitespace, a
    control character or a quote inside it. A URL carrying credentials (a user name or password, or a query string
    such as `?token=...`: a base URL needs none) is refused too, since a URL travels on command lines and into
    configs and logs (the simulators' token belongs in $SEAD_USER_SIM_API_KEY); no error repeats them.
    """
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    parsed: list[str] = []
    for position, raw in enumerate(items):
        if not isinstance(raw, str):
            raise ValueError(f"user-simulator url #{position} must be a string, got {type(raw).__name__}")
        if not raw.strip():
            continue
        url = _checked_url(raw.strip(), position).rstrip("/")
        if url.endswith("/v1"):
            url = url[: -len("/v1")]
        if url in parsed:
            raise ValueError(f"user-simulator url #{position} {_shown(raw)} is listed twice")
        parsed.append(url)
    if not parsed:
        raise ValueError("no user-simulator url given")
    return parsed


_KEY_HINT = "$SEAD_USER_SIM_API_KEY instead (a URL reaches command lines, configs and logs)"
_FORBIDDEN = frozenset("\"'`<>\\{}|^")
_CHAR_NAMES = {"\n": "a line break", "\r": "a carriage return", "\t": "a tab", " ": "a space", '"': "a quote",
               "'": "a quote", "`": "a backquote"}


def _checked_url(url: str, position: int) -> str:
    """`url` when it is a plain http(s)://host[:port][/path] URL without credentials (see `parse_urls`)."""
    where = f"user-simulator url #{position}"
    if "@" in url:
        raise ValueError(f"{where} {_shown(url)} carries a user name or password: give the simulators' token in "
                         f"{_KEY_HINT}")
    if "?" in url or "#" in url:
        raise ValueError(f"{where} {_shown(url)} carries a query string or fragment (a token such as ?token=... is a "
                         f"credential): a base URL has none; give the simulators' token in {_KEY_HINT}")
    bad = next((c for c in url if not c.isprintable() or c.isspace() or c in _FORBIDDEN), None)
    if bad is not None:
        raise ValueError(f"{where} {_shown(url)} contains {_CHAR_NAMES.get(bad, repr(bad))}, which no URL may")
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:  # not a number, or outside 0-65535
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port in (-1, 0):
        raise ValueError(f"{where} {_shown(url)} is not an http(s)://host[:port] URL with a port in 1-65535")
    return url


def _shown(text: str) -> str:
    """`text` as an error may show it: credentials (before an '@'), a query string or fragment and unprintable
    characters removed, at most 200 characters."""
    text = text.strip().split("?", 1)[0].split("#", 1)[0]
    if "@" in text:
        scheme, sep, _ = text.partition("//")
        prefix = scheme + sep if sep and "@" not in scheme else ""
        text = f"{prefix}<credentials removed>@{text.rpartition('@')[2]}"
    text = next((text[:i] for i, c in enumerate(text) if not c.isprintable()), text)  # nothing after a line break
    return repr(text[:200] + ("..." if len(text) > 200 else ""))


def instance_name(url: str) -> str:
    """The instance's label in replies, metrics and messages: host:port, plus the path when the URL has one."""
    parts = urlsplit(url)
    return parts.netloc + parts.path


def raise_for_status(response: HTTPReply) -> None:
    """Raise `AttemptError` for a non-200: 'overloaded' when the server shed load (429; 503 with code
    `overloaded`), 'http' (worth retrying elsewhere) for other 5xx and 408, else 'rejected' (the request itself
    is wrong: bad model name, missing API key, too long)."""
    if response.status_code == 200:
        return
    retryable = response.status_code >= 500 or response.status_code in (408, 429)
    detail = f"{response.method} {response.path}: HTTP {response.status_code}: {response.text[:200]!r}"
    if response.status_code == 429 or (response.status_code == 503 and _error_code(response) == "overloaded"):
        raise AttemptError("overloaded", detail)
    raise AttemptError("http" if retryable else "rejected", detail)


def _error_code(response: HTTPReply) -> str | None:
    """The `error.code` of an OpenAI-style error body, if it has one."""
    try:
        body = response.json()
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    return error.get("code") if isinstance(error, dict) else None


def completion_text(response: HTTPReply) -> str:
    """The first choice's message content of a chat-completion response, or raise `AttemptError('garbage')`."""
    try:
        body = response.json()
        content = body["choices"][0]["message"]["content"]
    except ValueError as exc:
        raise AttemptError("garbage", f"200 with a body that is not a chat completion ({exc})") from None
    except (KeyError, IndexError, TypeError) as exc:
        raise AttemptError("garbage", f"200 with a body that is not a chat completion ({exc!r})") from None
    if not isinstance(content, str):
        raise AttemptError("garbage", f"200 with non-string message content {content!r}")
    return content


def served_model_ids(response: HTTPReply) -> list[str]:
    """The model ids of a `GET /v1/models` reply (`{"data": [{"id": ...}, ...]}`); [] when it lists none,
    `AttemptError('garbage')` naming the problem when its body is not JSON the policy accepts."""
    try:
        body = response.json()
    except ValueError as exc:
        raise AttemptError("garbage", str(exc)) from None
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return []
    return [item["id"] for item in data if isinstance(item, dict) and isinstance(item.get("id"), str)]
