"""OpenAI chat-completions compatible user-simulator server (FastAPI + uvicorn).

    python -m llm_agent.user_sim.server --backend scripted|hf --port 5000 [--host 127.0.0.1] [--model PATH]
        [--api-key-file PATH] [--served-model-name NAME] [--scenario PATH] [--seed N]
        [--inject-latency-ms MEDIAN --inject-latency-sigma S] [--inject-fault none|garbage|hang|error]
        [--fault-rate P] [--max-request-bytes B] [--max-messages M] [--max-concurrency C] [--max-queue Q]
        [--max-connections K] [--header-timeout S] [--body-timeout S]

The API key (required as `Authorization: Bearer K` on /v1/* when set) comes from the environment variable
SEAD_USER_SIM_API_KEY or from a file readable by its owner only (`--api-key-file`), never from the command line
(which every local user can read in /proc/PID/cmdline); it is never logged.

Endpoints: `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`. Every error response is JSON in OpenAI's
error shape ({"error": {"message", "type", "param", "code"}}), malformed HTTP included; the only 5xx are the
injected `error` fault and 503 when the server is saturated (`code: overloaded`). Request validation is in
`chat_request.py`, transport limits in `http_guard.py`; the backends (`scripted.py`, `hf_backend.py`) only turn
validated messages into completions. Parsing and the backend run in a bounded thread pool
(`--max-concurrency` at once, `--max-queue` waiting), never on the event loop, so `/health` answers while
requests are being served.
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from llm_agent.api_keys import ApiKeyError, KeySafeArgumentParser, api_key, command_line_refusal
from llm_agent.scenario import DEFAULT_SCENARIO_PATH
from llm_agent.user_sim.server.backend import BackendInputError, BackendResult, ChatBackend, Completion, SamplingParams
from llm_agent.user_sim.server.chat_request import (DEFAULT_MAX_MESSAGES, ApiError, ChatRequest,  # noqa: F401
                                                    parse_chat_request)
from llm_agent.user_sim.server.faults import FAULT_KINDS, FaultConfig, FaultInjector
from llm_agent.user_sim.server.http_guard import guarded_protocol, install_log_limits, usable_connection_cap
from verl.utils.untrusted import clean_text

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
API_KEY_ENV = "SEAD_USER_SIM_API_KEY"


@dataclass(frozen=True)
class ServerConfig:
    """What the app needs besides the backend: the model name it answers to, auth, limits and faults."""

    served_model_name: str = "user-sim"
    backend_name: str = "scripted"
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_messages: int = DEFAULT_MAX_MESSAGES
    max_concurrency: int = 4
    max_queue: int = 64
    body_timeout_s: float = 5.0
    faults: FaultConfig = FaultConfig()

    def __repr__(self) -> str:  # the key never reaches a log line through the config
        return (f"ServerConfig(served_model_name={self.served_model_name!r}, backend_name={self.backend_name!r}, "
                f"api_key={'<set>' if self.api_key else None}, max_request_bytes={self.max_request_bytes}, "
                f"max_messages={self.max_messages}, max_concurrency={self.max_concurrency}, "
                f"max_queue={self.max_queue}, body_timeout_s={self.body_timeout_s}, faults={self.faults})")


class _ClientGone(Exception):
    """The client closed the connection before its request was read or answered (not a server error)."""


def _error_response(err: ApiError) -> JSONResponse:
    """The OpenAI-shaped JSON error; its text is cleaned (`clean_text`), since a message may quote a field of the
    request and a lone surrogate there would make the JSON unencodable (a plain-text 500)."""
    param = None if err.param is None else clean_text(err.param)
    body = {"error": {"message": clean_text(err.message), "type": err.type, "param": param, "code": err.code}}
    headers = {"retry-after": "1"} if err.status == 503 else {}
    if err.status in (408, 413):  # the body was not read to its end: the connection cannot carry another request
        headers["connection"] = "close"
    return JSONResponse(status_code=err.status, content=body, headers=headers or None)


async def _read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The request body; ApiError 413 as soon as it exceeds `limit` bytes (declared or actual), 408 when it has
    not fully arrived within `timeout_s`, _ClientGone when the client disconnects."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes",
                       code="request_too_large")
    chunks: list[bytes] = []
    size = 0

    async def read_all() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read_all(), timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(408, f"request body not received within {timeout_s:g} s", code="request_timeout") from None
    except ClientDisconnect:
        raise _ClientGone() from None
    return b"".join(chunks)


class _WorkGate:
    """At most `workers` parse+backend jobs at once in a dedicated thread pool and at most `queue` waiting;
    beyond that a request is refused with 503 (a saturated server sheds load instead of queueing forever)."""

    def __init__(self, workers: int, queue: int) -> None:
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sim-backend")
        self.workers, self.queue = workers, queue
        self.running = self.waiting = 0
        self._free: asyncio.Semaphore | None = None

    async def run(self, fn, *args):
        """fn(*args) in the pool; ApiError 503 when the pool and its queue are full."""
        if self._free is None:
            self._free = asyncio.Semaphore(self.workers)
        if self._free.locked() and self.waiting >= self.queue:
            raise ApiError(503, f"server overloaded: {self.workers} requests running and {self.waiting} waiting",
                           type="server_error", code="overloaded")
        self.waiting += 1
        try:
            await self._free.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
        finally:
            self.running -= 1
            self._free.release()


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
    """The FastAPI app serving `backend` under `config` (auth, limits, served model name, faults)."""
    app = FastAPI(title="SEAD user simulator", docs_url=None, redoc_url=None, openapi_url=None)
    injector = FaultInjector(config.faults)
    gate = _WorkGate(config.max_concurrency, config.max_queue)
    app.state.gate = gate

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, err: ApiError) -> JSONResponse:
        return _error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _error_response(ApiError(exc.status_code, str(exc.detail), code=code))

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
        return {"status": "ok", "backend": config.backend_name, "model": config.served_model_name,
                "pid": os.getpid(), "running": gate.running, "waiting": gate.waiting}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        check_auth(request)
        card = {"id": config.served_model_name, "object": "model", "created": 0, "owned_by": "sead"}
        return {"object": "list", "data": [card]}

    def parse_and_complete(raw: bytes) -> tuple[ChatRequest, BackendResult | None]:
        req = parse_chat_request(raw, config.max_messages)
        if req.model != config.served_model_name:
            raise ApiError(404, f"the model {req.model!r} does not exist; this server serves "
                                f"{config.served_model_name!r}", param="model", code="model_not_found")
        if injector.config.active:
            return req, None  # faults are drawn first (on the loop), then the backend runs
        return req, complete(req)

    def complete(req: ChatRequest) -> BackendResult:
        params = SamplingParams(n=req.n, temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                                max_tokens=req.max_tokens)
        try:
            return backend.complete(req.messages, params)
        except BackendInputError as err:
            raise ApiError(400, str(err), param="messages") from err

    async def serve(request: Request) -> Response:
        check_auth(request)
        raw = await _read_body(request, config.max_request_bytes, config.body_timeout_s)
        req, result = await gate.run(parse_and_complete, raw)
        if result is None:
            await injector.delay()
            fault = injector.draw_fault()
            if fault == "hang":
                await injector.hang(request.is_disconnected)
                return Response(status_code=499)
            if fault == "error":
                raise ApiError(503, "injected fault: service unavailable", type="server_error",
                               code="injected_fault")
            if fault == "garbage":
                return Response(content=injector.garbage_body(), status_code=200, media_type="application/json")
            result = await gate.run(complete, req)
        body = _completion_body(_apply_stop(result, req.stop), config.served_model_name)
        if req.stream:
            return StreamingResponse(_sse_stream(body), media_type="text/event-stream")
        return JSONResponse(body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            return await serve(request)
        except ApiError as err:
            return _error_response(err)
        except _ClientGone:
            logger.info("client disconnected before its request was answered")
            return Response(status_code=499)
        except Exception as exc:  # one log line with the traceback, one JSON 500, nothing re-raised
            logger.exception("internal error while serving a chat completion")
            return _error_response(ApiError(500, f"internal server error: {type(exc).__name__}",
                                            type="server_error"))

    return app


def _make_backend(args: argparse.Namespace) -> ChatBackend:
    if args.backend == "hf":
        if not args.model:
            raise SystemExit("--backend hf needs --model PATH (a local transformers model directory)")
        from llm_agent.user_sim.server.hf_backend import HFChatBackend

        return HFChatBackend(args.model, seed=args.seed)
    from llm_agent.user_sim.server.scripted import ScriptedPersonaBackend

    return ScriptedPersonaBackend.from_scenario_file(args.scenario, seed=args.seed)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of the server (see the module docstring)."""
    p = KeySafeArgumentParser(prog="python -m llm_agent.user_sim.server", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("scripted", "hf"), default="scripted")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback unless told otherwise)")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--model", default=None, help="local model directory (hf backend)")
    p.add_argument("--scenario", default=str(DEFAULT_SCENARIO_PATH), help="scenario YAML (scripted backend)")
    p.add_argument("--served-model-name", default="user-sim")
    p.add_argument("--api-key", default=None, help=argparse.SUPPRESS)
    p.add_argument("--api-key-file", default=None,
                   help=f"file holding the key required as 'Authorization: Bearer K' on /v1/* (mode 0600, owned by "
                        f"you); or set {API_KEY_ENV}")
    p.add_argument("--seed", type=int, default=0, help="base seed of the backend and the fault injector")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES)
    p.add_argument("--max-messages", type=int, default=DEFAULT_MAX_MESSAGES, help="messages per request")
    p.add_argument("--max-concurrency", type=int, default=4, help="requests parsed/answered at once (threads)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a thread; more get 503")
    p.add_argument("--max-connections", type=int, default=1024, help="open connections; more are closed")
    p.add_argument("--header-timeout", type=float, default=10.0, help="seconds to receive request headers")
    p.add_argument("--body-timeout", type=float, default=ServerConfig.body_timeout_s,
                   help="seconds to receive a request body (a chat request is a few KB)")
    p.add_argument("--inject-latency-ms", type=float, default=0.0, help="median of the lognormal latency")
    p.add_argument("--inject-latency-sigma", type=float, default=0.0, help="log-space sigma of the latency")
    p.add_argument("--inject-fault", choices=FAULT_KINDS, default="none")
    p.add_argument("--fault-rate", type=float, default=1.0, help="share of requests hit by --inject-fault")
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def read_api_key(path: str | None) -> str | None:
    """The API key from `path` (a file that only its owner, who must be us, can read or write) or from the
    environment variable SEAD_USER_SIM_API_KEY; None when neither is set. SystemExit names the problem."""
    try:
        return api_key(API_KEY_ENV, path)
    except ApiKeyError as err:
        raise SystemExit(f"error: {err}") from None


def main(argv: list[str] | None = None) -> None:
    """Build the backend and serve it with uvicorn until SIGTERM/SIGINT."""
    args = parse_args(argv)
    if args.api_key is not None:
        raise SystemExit(f"error: {command_line_refusal('--api-key', API_KEY_ENV)}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("max_request_bytes", "max_messages", "max_concurrency", "max_queue", "max_connections"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("header_timeout", "body_timeout"):
        if not getattr(args, name) > 0:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be > 0 seconds, got {getattr(args, name)}")
    try:
        faults = FaultConfig(args.inject_latency_ms, args.inject_latency_sigma, args.inject_fault,
                             args.fault_rate, args.seed)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from err
    config = ServerConfig(served_model_name=args.served_model_name, backend_name=args.backend,
                          api_key=read_api_key(args.api_key_file), max_request_bytes=args.max_request_bytes,
                          max_messages=args.max_messages, max_concurrency=args.max_concurrency,
                          max_queue=args.max_queue, body_timeout_s=args.body_timeout, faults=faults)
    try:
        backend = _make_backend(args)
    except (OSError, ValueError) as err:  # ScenarioError is a ValueError naming the file and key
        raise SystemExit(f"error: cannot start the {args.backend} backend: {err}") from err
    app = build_app(backend, config)
    if faults.active:
        logger.warning("fault injection on: %s", faults)
    connections = usable_connection_cap(args.max_connections)
    protocol = guarded_protocol(connections, args.header_timeout)
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(), http=protocol,
                               timeout_keep_alive=5, timeout_graceful_shutdown=3)
    install_log_limits()  # after uvicorn configured its loggers
    uvicorn.Server(uv_config).run()
