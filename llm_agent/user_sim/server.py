"""OpenAI chat-completions compatible user-simulator server (FastAPI + uvicorn).

    python -m llm_agent.user_sim.server --backend scripted|hf --port 5000 [--host 127.0.0.1] [--model PATH]
        [--api-key K] [--served-model-name NAME] [--scenario PATH] [--seed N]
        [--inject-latency-ms MEDIAN --inject-latency-sigma S] [--inject-fault none|garbage|hang|error]
        [--fault-rate P] [--max-request-bytes B]

Endpoints: `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`. Every malformed request gets a 4xx
JSON body in OpenAI's error shape ({"error": {"message", "type", "param", "code"}}); the injected `error`
fault (503) is the only deliberate 5xx. Request validation lives here (`parse_chat_request`); the backends
(`scripted.py`, `hf_backend.py`) only turn validated messages into completions.
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llm_agent.user_sim.backend import BackendInputError, BackendResult, ChatBackend, Completion, SamplingParams
from llm_agent.user_sim.faults import FAULT_KINDS, FaultConfig, FaultInjector

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SCENARIO = str(REPO_ROOT / "verl/trainer/config/format_prompt/outbound_ad_trial.yaml")
DEFAULT_MAX_REQUEST_BYTES = 1 << 20

MAX_N = 128
SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)  # what torch.manual_seed accepts (hf backend)
ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """An HTTP error answered in OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


@dataclass
class ChatRequest:
    """A validated chat-completions request (unknown OpenAI fields are accepted and ignored)."""

    model: str
    messages: list[dict[str, str]]
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int | None = None
    stream: bool = False
    stop: list[str] = field(default_factory=list)


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text(where: str, value: str) -> str:
    """`value` unchanged, or a 400 when it holds a lone surrogate (JSON allows "\\ud800"; UTF-8 does not)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise _bad(where, f"not valid Unicode text ({err.reason} at position {err.start})") from None
    return value


def _number(body: dict, key: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if not (_is_int(value) or isinstance(value, float)):
        raise _bad(key, f"expected a finite number, got {value!r}")
    try:
        number = float(value)  # an integer literal too large for a float raises OverflowError
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise _bad(key, f"expected a finite number, got {str(value)[:40]}")
    value = number
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise _bad(key, f"{value} is outside {bracket}{low}, {high}]")
    return float(value)


def _message_text(index: int, message: Any) -> dict[str, str]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise _bad(where, f"expected an object with 'role' and 'content', got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise _bad(f"{where}.role", f"expected one of {ROLES}, got {role!r}")
    content = message.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"{where}.content[{j}]", "only {'type': 'text', 'text': str} parts are supported")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise _bad(f"{where}.content", f"expected a string or a list of text parts, got {type(content).__name__}")
    return {"role": role, "content": _text(f"{where}.content", content)}


def parse_chat_request(raw: bytes) -> ChatRequest:
    """Validate a chat-completions body; raise ApiError(400) naming the offending field."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise ApiError(400, f"request body is not valid JSON: {err}", code="invalid_json") from err
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", f"a non-empty string is required, got {model!r}")
    _text("model", model)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "a non-empty list of messages is required")
    n = body.get("n", 1)
    n = 1 if n is None else n
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise _bad("n", f"expected an integer in [1, {MAX_N}], got {n!r}")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        raise _bad("seed", f"expected an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}] or null, "
                           f"got {str(seed)[:40]}")
    max_tokens = None
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None:
            if not _is_int(value) or value < 1:
                raise _bad(key, f"expected a positive integer, got {value!r}")
            max_tokens = value
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise _bad("stream", f"expected a boolean, got {stream!r}")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) for s in stop):
        raise _bad("stop", "expected a string or a list of at most 4 strings")
    stop = [_text(f"stop[{i}]", s) for i, s in enumerate(stop)]
    return ChatRequest(
        model=model,
        messages=[_message_text(i, m) for i, m in enumerate(messages)],
        n=n,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        seed=seed,
        max_tokens=max_tokens,
        stream=bool(stream),
        stop=stop,
    )


@dataclass(frozen=True)
class ServerConfig:
    """What the app needs besides the backend: the model name it answers to, auth, limits and faults."""

    served_model_name: str = "user-sim"
    backend_name: str = "scripted"
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    faults: FaultConfig = FaultConfig()


def _error_response(err: ApiError) -> JSONResponse:
    body = {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}
    return JSONResponse(status_code=err.status, content=body)


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, or ApiError 413 as soon as it exceeds `limit` bytes (declared or actual)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes",
                       code="request_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _completion_body(result: BackendResult, model: str) -> dict:
    choices = [
        {"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
         "finish_reason": c.finish_reason}
        for i, c in enumerate(result.choices)
    ]
    completion_tokens = sum(c.completion_tokens for c in result.choices)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {"prompt_tokens": result.prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": result.prompt_tokens + completion_tokens},
    }


async def _sse_stream(body: dict) -> AsyncIterator[bytes]:
    """Replay a finished completion as OpenAI `chat.completion.chunk` server-sent events."""
    base = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"], "model": body["model"]}
    for choice in body["choices"]:
        delta = {"role": "assistant", "content": choice["message"]["content"]}
        for chunk_choice in ({"index": choice["index"], "delta": delta, "finish_reason": None},
                             {"index": choice["index"], "delta": {}, "finish_reason": choice["finish_reason"]}):
            yield f"data: {json.dumps({**base, 'choices': [chunk_choice]})}\n\n".encode()
    yield b"data: [DONE]\n\n"


def _apply_stop(result: BackendResult, stop: list[str]) -> BackendResult:
    """Cut each choice at its first stop string (OpenAI semantics: the stop string is not returned)."""
    if not stop:
        return result
    cut = []
    for c in result.choices:
        positions = [c.text.find(s) for s in stop if s and s in c.text]
        if positions:
            cut.append(Completion(c.text[: min(positions)], "stop", c.completion_tokens))
        else:
            cut.append(c)
    return BackendResult(choices=cut, prompt_tokens=result.prompt_tokens)


def build_app(backend: ChatBackend, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving `backend` under `config` (auth, size limit, served model name, faults)."""
    app = FastAPI(title="SEAD user simulator", docs_url=None, redoc_url=None, openapi_url=None)
    injector = FaultInjector(config.faults)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, err: ApiError) -> JSONResponse:
        return _error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _error_response(ApiError(exc.status_code, str(exc.detail), code=code))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error while serving a request")
        return _error_response(ApiError(500, f"internal server error: {type(exc).__name__}", type="server_error"))

    def check_auth(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           type="authentication_error", code="invalid_api_key")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "backend": config.backend_name, "model": config.served_model_name}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        check_auth(request)
        card = {"id": config.served_model_name, "object": "model", "created": 0, "owned_by": "sead"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        check_auth(request)
        req = parse_chat_request(await _read_body(request, config.max_request_bytes))
        if req.model != config.served_model_name:
            raise ApiError(404, f"the model {req.model!r} does not exist; this server serves "
                                f"{config.served_model_name!r}", param="model", code="model_not_found")
        await injector.delay()
        fault = injector.draw_fault()
        if fault == "hang":
            await injector.hang(request.is_disconnected)
            return Response(status_code=499)
        if fault == "error":
            raise ApiError(503, "injected fault: service unavailable", type="server_error", code="injected_fault")
        if fault == "garbage":
            return Response(content=injector.garbage_body(), status_code=200, media_type="application/json")
        params = SamplingParams(n=req.n, temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                                max_tokens=req.max_tokens)
        try:
            result = await asyncio.to_thread(backend.complete, req.messages, params)
        except BackendInputError as err:
            raise ApiError(400, str(err), param="messages") from err
        body = _completion_body(_apply_stop(result, req.stop), config.served_model_name)
        if req.stream:
            return StreamingResponse(_sse_stream(body), media_type="text/event-stream")
        return JSONResponse(body)

    return app


def _make_backend(args: argparse.Namespace) -> ChatBackend:
    if args.backend == "hf":
        if not args.model:
            raise SystemExit("--backend hf needs --model PATH (a local transformers model directory)")
        from llm_agent.user_sim.hf_backend import HFChatBackend

        return HFChatBackend(args.model, seed=args.seed)
    from llm_agent.user_sim.scripted import ScriptedPersonaBackend

    return ScriptedPersonaBackend.from_scenario_file(args.scenario, seed=args.seed)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of the server (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m llm_agent.user_sim.server", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("scripted", "hf"), default="scripted")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback unless told otherwise)")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--model", default=None, help="local model directory (hf backend)")
    p.add_argument("--scenario", default=DEFAULT_SCENARIO, help="scenario YAML (scripted backend)")
    p.add_argument("--served-model-name", default="user-sim")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer K' on /v1/*")
    p.add_argument("--seed", type=int, default=0, help="base seed of the backend and the fault injector")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES)
    p.add_argument("--inject-latency-ms", type=float, default=0.0, help="median of the lognormal latency")
    p.add_argument("--inject-latency-sigma", type=float, default=0.0, help="log-space sigma of the latency")
    p.add_argument("--inject-fault", choices=FAULT_KINDS, default="none")
    p.add_argument("--fault-rate", type=float, default=1.0, help="share of requests hit by --inject-fault")
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Build the backend and serve it with uvicorn until SIGTERM/SIGINT."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        faults = FaultConfig(args.inject_latency_ms, args.inject_latency_sigma, args.inject_fault,
                             args.fault_rate, args.seed)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from err
    config = ServerConfig(served_model_name=args.served_model_name, backend_name=args.backend,
                          api_key=args.api_key, max_request_bytes=args.max_request_bytes, faults=faults)
    try:
        backend = _make_backend(args)
    except (OSError, ValueError) as err:  # ScenarioError is a ValueError naming the file and key
        raise SystemExit(f"error: cannot start the {args.backend} backend: {err}") from err
    app = build_app(backend, config)
    if faults.active:
        logger.warning("fault injection on: %s", faults)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                timeout_graceful_shutdown=3)


if __name__ == "__main__":
    main()
