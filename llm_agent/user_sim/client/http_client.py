"""Fault-tolerant client for N OpenAI-compatible user-simulator instances.

Every dialogue's turn is its own ``POST {url}/v1/chat/completions``. A batch is sent concurrently (asyncio +
aiohttp on a private event-loop thread) and each request goes to the healthy instance with the lowest load score
(`routing.py`: a peak-EWMA latency estimate times the requests in flight, divided by the share of useful
replies), so a slow instance receives work in proportion to its speed and one whose replies fail gets little.
A re-request of a reply the caller refused (`TurnRequest.avoid`) goes to another instance when one is up, and
the refusal counts against the instance that sent it. A failed attempt (connection error, timeout, non-200, or a
200 whose body is not a chat completion) is retried after a backoff on another instance when one exists. Every
reply body is decoded by the project's policy for outside input (`verl.utils.untrusted.load_json`: size and
nesting limits, text cleaned), so a hostile body is a failed attempt, never an exception. A request an instance
shed because it is saturated (HTTP 429, or 503 with code ``overloaded``) is sent again after a growing pause
without using up an attempt or counting against the instance's health, for at most ``timeout_s`` of wall time per
turn (requests and pauses together); after that a shed is a failed attempt. An instance with
``down_after_failures`` consecutive failures is marked down and probed with ``GET /health``
every ``probe_interval_s`` until it answers; the client never restarts or kills a server. A turn that cannot
be answered within ``max_attempts`` attempts and the batch deadline comes back as a :class:`TurnFailure`,
never as a made-up reply. Every wait is bounded: one attempt by ``timeout_s``, a batch by ``deadline_s``.
``check_instances()`` verifies every instance before training (health and served model). A model name that was
discovered (not configured) is looked up again when an instance answers 404, so a server restarted under
another served name keeps working.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import threading
import time
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import aiohttp

from llm_agent.user_sim.client.config import UserSimConfig
from llm_agent.user_sim.client.http_pool import ResponseTooLarge, SimulatorHTTP
from llm_agent.user_sim.client.protocol import SimulatorClient, TurnFailure, TurnReply, TurnRequest, TurnResult
from llm_agent.user_sim.client.stats import ClientStats, InstanceState
from llm_agent.user_sim.client.wire import (AttemptError, SimulatorCheckError, completion_text, instance_name,
                                            parse_urls, raise_for_status, served_model_ids)

logger = logging.getLogger(__name__)

T = TypeVar("T")

MAX_SHED_PAUSE_S = 2.0  # the longest pause before re-sending a request an instance shed

__all__ = ["UserSimClient"]


class UserSimClient(SimulatorClient):
    """Sends dialogue turns to N simulator instances with least-in-flight routing, retries and health probes.

    A `SimulatorClient` with an event loop of its own: `acomplete` is awaited on it, inside `run_on_loop`.
    """

    def __init__(
        self,
        urls: str | list[str],
        model: str | None = None,
        api_key: str | None = None,
        timeout_s: float = UserSimConfig.timeout_s,
        max_attempts: int = UserSimConfig.max_attempts,
        deadline_s: float | None = None,
        down_after_failures: int = 3,
        probe_interval_s: float = 2.0,
        backoff_s: float = 0.2,
        max_in_flight: int = 256,
    ) -> None:
        for name, value in (("timeout_s", timeout_s), ("probe_interval_s", probe_interval_s)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"UserSimClient: {name} must be a finite number > 0, got {value}")
        for name, value in (("max_attempts", max_attempts), ("down_after_failures", down_after_failures),
                            ("max_in_flight", max_in_flight)):
            if value < 1:
                raise ValueError(f"UserSimClient: {name} must be >= 1, got {value}")
        if deadline_s is not None and not (math.isfinite(deadline_s) and deadline_s > 0):
            raise ValueError(f"UserSimClient: deadline_s must be a finite number > 0 or None, got {deadline_s}")
        if not (math.isfinite(backoff_s) and backoff_s >= 0):
            raise ValueError(f"UserSimClient: backoff_s must be a finite number >= 0, got {backoff_s}")
        self.timeout_s = float(timeout_s)
        self.max_attempts = max_attempts
        self.deadline_s = deadline_s
        self.down_after_failures = down_after_failures
        self.probe_interval_s = float(probe_interval_s)
        self.backoff_s = float(backoff_s)
        self.max_in_flight = max_in_flight
        self._instances = [InstanceState(url=u, name=instance_name(u), model=model) for u in parse_urls(urls)]
        self._configured_model = model
        api_key = api_key or os.environ.get("SEAD_USER_SIM_API_KEY")  # the env keeps the key out of configs/logs
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._stats = ClientStats(self._instances)
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="user-sim-client", daemon=True)
        self._thread.start()
        self._call(self._setup())

    @property
    def instances(self) -> list[str]:
        """The instances' names (host:port), in the order given."""
        return [inst.name for inst in self._instances]

    def check_instances(self, timeout_s: float = 10.0) -> dict[str, str]:
        """Check every instance now: `GET /health` answers 200 and `GET /v1/models` lists the configured model (or
        any model when none is configured). Returns {instance: served model}; SimulatorCheckError names every
        instance that failed and why."""
        return self._call(self._check_all(timeout_s))

    async def _check_all(self, timeout_s: float) -> dict[str, str]:
        problems, served = [], {}
        for inst in self._instances:
            try:
                health = await self._http.get(f"{inst.url}/health", timeout=timeout_s)
                if health.status_code != 200:
                    raise AttemptError("http", f"GET /health answered HTTP {health.status_code}")
                listed = await self._http.get(f"{inst.url}/v1/models", timeout=timeout_s)
                raise_for_status(listed)
                ids = served_model_ids(listed)
                if not ids:
                    raise AttemptError("garbage", "GET /v1/models lists no model")
                if self._configured_model is not None and self._configured_model not in ids:
                    raise AttemptError("rejected", f"serves {ids}, not the configured model "
                                                   f"{self._configured_model!r} (rollout_loop.config.user_sim.model)")
                served[inst.name] = self._configured_model or ids[0]
            except AttemptError as exc:
                problems.append(f"{inst.name}: {exc}")
            except ResponseTooLarge as exc:
                problems.append(f"{inst.name}: {exc}")
            except (aiohttp.ClientError, TimeoutError) as exc:
                problems.append(f"{inst.name}: unreachable ({type(exc).__name__}: {exc})")
        if problems:
            raise SimulatorCheckError("user simulator check failed for " + "; ".join(problems))
        return served

    def _call(self, coro):
        """Run a coroutine on the client's loop thread and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _setup(self) -> None:
        """Create the loop-bound objects: HTTP connection pool, concurrency cap, up/down condition."""
        self._http = SimulatorHTTP(self.max_in_flight + 2 * len(self._instances), self.timeout_s, self._headers)
        self._slots = asyncio.Semaphore(self.max_in_flight)
        self._up_changed = asyncio.Condition()
        for inst in self._instances:
            inst.model_lock = asyncio.Lock()

    def complete(self, requests: Sequence[TurnRequest]) -> list[TurnResult]:
        """Complete every request concurrently; returns one TurnReply or TurnFailure per request, in order.
        `deadline_s` bounds the whole batch."""
        if self._closed:
            raise RuntimeError("UserSimClient.complete called after close()")
        for i, req in enumerate(requests):
            if not isinstance(req, TurnRequest):
                raise TypeError(f"complete: requests[{i}] is {type(req).__name__}, expected TurnRequest")
        if not requests:
            return []
        return self._call(self._complete_all(list(requests)))

    def run_on_loop(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run `coroutine` on the client's event loop and wait for its result (cancelled if the wait is
        interrupted). Code running there awaits `acomplete` with no thread hop per request: the async rollout
        loop runs all its dialogues this way."""
        if self._closed:
            coroutine.close()
            raise RuntimeError("UserSimClient.run_on_loop called after close()")
        if threading.current_thread() is self._thread:
            coroutine.close()
            raise RuntimeError("UserSimClient.run_on_loop called from the client's own loop; await the coroutine")
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    async def acomplete(self, request: TurnRequest) -> TurnResult:
        """Complete one request (one dialogue's turn); await it on the client's loop (inside `run_on_loop`).
        `deadline_s` bounds this request alone."""
        if self._closed:
            raise RuntimeError("UserSimClient.acomplete called after close()")
        if not isinstance(request, TurnRequest):
            raise TypeError(f"acomplete: request is {type(request).__name__}, expected TurnRequest")
        if asyncio.get_running_loop() is not self._loop:
            raise RuntimeError("UserSimClient.acomplete must be awaited on the client's own loop (run_on_loop)")
        return (await self._complete_all([request]))[0]

    async def _complete_all(self, requests: list[TurnRequest]) -> list[TurnResult]:
        deadline = None if self.deadline_s is None else time.monotonic() + self.deadline_s
        results = await asyncio.gather(*(self._complete_one(req, deadline) for req in requests))
        failed = sum(isinstance(r, TurnFailure) for r in results)
        self._stats.count_batch(len(results), failed)
        if failed:
            logger.warning("user simulator: %d of %d turns failed on every attempt", failed, len(results))
        return list(results)

    def _pick(self, tried: list[str], avoid: tuple[str, ...] = ()) -> InstanceState | None:
        """The up instance with the lowest load score (`routing.LoadScore`), preferring ones this turn has neither
        tried yet nor had a reply refused by (`avoid`), then ones it has not had a reply refused by."""
        up = [inst for inst in self._instances if not inst.down]
        if not up:
            return None
        allowed = [inst for inst in up if inst.name not in avoid]
        fresh = [inst for inst in allowed if inst.name not in tried]
        pool = fresh or allowed or up
        known = [inst.load.latency_s for inst in self._instances if inst.load.latency_s is not None]
        fallback = min(known, default=None)
        return min(pool, key=lambda inst: (inst.load.score(inst.in_flight, fallback), inst.in_flight, inst.requests))

    def _count_refusal(self, req: TurnRequest) -> None:
        """The caller refused the reply of `req.avoid[-1]` (the newest refusal): count it against that instance."""
        inst = next((i for i in self._instances if i.name == req.avoid[-1]), None)
        if inst is not None:
            self._stats.count_failure(inst, "protocol")
            inst.load.refused(time.monotonic())

    async def _wait_until_up(self, budget_s: float) -> bool:
        """Wait up to `budget_s` for some instance to be up (a probe succeeding); True if one is."""
        try:
            async with asyncio.timeout(budget_s):
                async with self._up_changed:
                    await self._up_changed.wait_for(lambda: any(not i.down for i in self._instances))
            return True
        except TimeoutError:
            return False

    def _remaining(self, deadline: float | None) -> float | None:
        """Seconds left before the batch deadline (None when there is no deadline)."""
        return None if deadline is None else deadline - time.monotonic()

    async def _complete_one(self, req: TurnRequest, deadline: float | None) -> TurnResult:
        """All attempts of one turn, each on the least-loaded up instance not yet tried when possible.

        A request an instance shed (`overloaded`) does not use up an attempt: it is sent again after a pause that
        doubles up to `MAX_SHED_PAUSE_S`, while the turn is younger than `timeout_s` (its requests and pauses
        together); a later shed is a failed attempt. So a turn without a deadline lasts at most `timeout_s` plus
        `max_attempts` attempts and their backoff pauses."""
        if req.avoid:
            self._count_refusal(req)
        errors: list[str] = []
        tried: list[str] = []
        attempts = sheds = 0
        pause = 0.0
        started = time.monotonic()
        while attempts < self.max_attempts:
            if pause:
                remaining = self._remaining(deadline)
                await asyncio.sleep(pause if remaining is None else max(0.0, min(pause, remaining)))
            remaining = self._remaining(deadline)
            if remaining is not None and remaining <= 0:
                return TurnFailure(req.dialogue_id, f"deadline of {self.deadline_s}s exceeded", attempts, errors)
            try:
                if self._pick(tried) is None:
                    wait_s = self.timeout_s if remaining is None else min(self.timeout_s, remaining)
                    if not await self._wait_until_up(wait_s):
                        raise AttemptError("unavailable", f"no instance up within {wait_s:.2f}s")
                inst, text, latency = await self._send(req, tried, deadline)
            except AttemptError as exc:
                pause = min(MAX_SHED_PAUSE_S, self.backoff_s * 2 ** sheds) * random.uniform(0.5, 1.0)
                if exc.kind == "overloaded" and time.monotonic() + pause - started < self.timeout_s:
                    tried.pop()  # the instance is busy, not failing: it may be picked again
                    sheds += 1
                    continue
                attempts += 1
                errors.append(f"attempt {attempts}: {exc}")
                if exc.kind == "rejected":
                    return TurnFailure(req.dialogue_id, f"request rejected: {exc}", attempts, errors)
                pause = self.backoff_s * 2 ** (attempts - 1) * random.uniform(0.5, 1.0)
                continue
            return TurnReply(req.dialogue_id, text, inst.name, latency, attempts + 1)
        return TurnFailure(req.dialogue_id, f"all {attempts} attempts failed", attempts, errors)

    async def _send(self, req: TurnRequest, tried: list[str], deadline: float | None) -> tuple[InstanceState, str, float]:
        """One request: wait for an in-flight slot, route, send, validate, and update the instance's health."""
        try:
            async with asyncio.timeout_at(deadline):  # the loop's clock is time.monotonic()
                await self._slots.acquire()
        except TimeoutError:
            raise AttemptError("deadline", "deadline reached while queued for an in-flight slot") from None
        try:
            inst = self._pick(tried, req.avoid)
            if inst is None:
                raise AttemptError("unavailable", "every instance went down while queued")
            self._stats.count_request(inst, tried[-1] if tried else None)
            tried.append(inst.name)
            remaining = self._remaining(deadline)
            budget = self.timeout_s if remaining is None else min(self.timeout_s, remaining)
            inst.in_flight += 1
            sent = time.monotonic()
            try:
                async with asyncio.timeout(max(budget, 1e-3)):
                    text = await self._post(inst, req)
            except TimeoutError:
                if budget < self.timeout_s:
                    raise AttemptError("deadline", f"{inst.name}: no answer before the deadline") from None
                self._record_failure(inst, "timeout")
                raise AttemptError("timeout", f"{inst.name}: no answer within {budget:.2f}s") from None
            except ResponseTooLarge as exc:
                self._record_failure(inst, "garbage")
                raise AttemptError("garbage", f"{inst.name}: {exc}") from None
            except aiohttp.ClientError as exc:
                self._record_failure(inst, "connection")
                raise AttemptError("connection", f"{inst.name}: {type(exc).__name__}: {exc}") from None
            except AttemptError as exc:
                if exc.kind == "overloaded":  # busy, not broken: counted, but never marks the instance down
                    self._stats.count_failure(inst, exc.kind)
                elif exc.kind != "rejected":
                    self._record_failure(inst, exc.kind)
                raise AttemptError(exc.kind, f"{inst.name}: {exc}") from None
            finally:
                inst.in_flight -= 1
        finally:
            self._slots.release()
        now = time.monotonic()
        latency = now - sent
        self._stats.count_success(inst, latency)
        inst.load.reply(latency, now)
        inst.consecutive_failures = 0
        return inst, text, latency

    async def _post(self, inst: InstanceState, req: TurnRequest) -> str:
        """POST the chat completion to one instance and return the reply text (raises on any failure)."""
        if inst.model is None:
            await self._discover_model(inst)
        body = {"model": inst.model, "messages": req.messages, "n": 1, "temperature": req.temperature,
                "top_p": req.top_p, "max_tokens": req.max_tokens}
        if req.seed is not None:
            body["seed"] = req.seed
        response = await self._http.post(f"{inst.url}/v1/chat/completions", json=body)
        if response.status_code == 404 and self._configured_model is None:
            old, inst.model = inst.model, None  # restarted under another served name? ask again, send once more
            await self._discover_model(inst)
            if inst.model != old:
                logger.warning("user simulator %s now serves %r (was %r)", inst.name, inst.model, old)
                body["model"] = inst.model
                response = await self._http.post(f"{inst.url}/v1/chat/completions", json=body)
        raise_for_status(response)
        return completion_text(response)

    async def _discover_model(self, inst: InstanceState) -> None:
        """Ask `GET /v1/models` once for the instance's served model name."""
        async with inst.model_lock:
            if inst.model is not None:
                return
            response = await self._http.get(f"{inst.url}/v1/models")
            raise_for_status(response)
            ids = served_model_ids(response)
            if not ids:
                raise AttemptError("garbage", "GET /v1/models answered 200 without a model id")
            inst.model = model = ids[0]
            logger.info("user simulator %s serves model %r", inst.name, model)

    def _record_failure(self, inst: InstanceState, kind: str) -> None:
        """Count a failed attempt and mark the instance down after `down_after_failures` in a row."""
        self._stats.count_failure(inst, kind)
        inst.load.failed(time.monotonic())
        inst.consecutive_failures += 1
        if not inst.down and inst.consecutive_failures >= self.down_after_failures:
            inst.down = True
            self._stats.count_marked_down(inst)
            logger.warning("user simulator %s marked down after %d consecutive failures (last: %s); "
                           "probing /health every %.1fs", inst.name, inst.consecutive_failures, kind,
                           self.probe_interval_s)
            inst.probe_task = asyncio.get_running_loop().create_task(self._probe(inst))

    async def _probe(self, inst: InstanceState) -> None:
        """Poll `GET /health` until it answers 200, then put the instance back on probation (one strike)."""
        while True:
            await asyncio.sleep(self.probe_interval_s)
            try:
                response = await self._http.get(f"{inst.url}/health",
                                                timeout=min(self.timeout_s, max(self.probe_interval_s, 1.0)))
            except (aiohttp.ClientError, TimeoutError):
                continue
            if response.status_code == 200:
                break
        inst.consecutive_failures = self.down_after_failures - 1
        async with self._up_changed:
            inst.down = False
            self._up_changed.notify_all()
        logger.info("user simulator %s answers /health again; back in rotation", inst.name)

    def stats(self) -> dict[str, float]:
        """Per-instance and total counters flattened for metrics (keys: `ClientStats.snapshot`)."""
        return self._stats.snapshot()

    def reset_stats(self) -> None:
        """Zero the counters and latency windows (health state and in-flight counts are kept)."""
        self._stats.reset()

    def close(self) -> None:
        """Stop the probes, close the connections and the loop thread (idempotent; servers are left running)."""
        if self._closed:
            return
        self._closed = True
        self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _shutdown(self) -> None:
        probes = [inst.probe_task for inst in self._instances if inst.probe_task and not inst.probe_task.done()]
        for task in probes:
            task.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        await self._http.aclose()

    def __enter__(self) -> UserSimClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
