"""Property-based fuzzing of the simulator server over loopback HTTP (Hypothesis, derandomized and bounded).

One scripted server runs for the module. Hostile JSON bodies, random bytes, hostile tag soups and sizes, raw
malformed HTTP, slow clients and bursts are thrown at it while a thread polls `/health`. Properties: every
answer is 2xx or 4xx (503 only as the documented overload answer) with a JSON body in OpenAI's error shape,
a 200 is a well-formed chat completion, `/health` answers within 1 s throughout, and the RSS stays bounded.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from llm_agent.scenario import DEFAULT_SCENARIO_PATH, load_scenario

from tests.helpers.sim_servers import SimServers
from tests.helpers.profiles import profile3

pytestmark = [pytest.mark.processes, pytest.mark.timeout(600)]
SCENARIO = load_scenario(DEFAULT_SCENARIO_PATH)
PERSONA = SCENARIO.render_user_prompt(profile3(2, 1, 3, behaviors=()))
FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MAX_BODY = 256 * 1024


class Monitor:
    """Polls /health every 50 ms in a thread and records each answer's latency (inf for a failure)."""

    client: httpx.Client  # the tests' shared client (one connection pool for all examples)

    def __init__(self, url: str, pid: int) -> None:
        self.url, self.pid = url, pid
        self.latencies: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.rss_start = self.rss()

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self.stop.is_set():
                start = time.monotonic()
                try:
                    ok = client.get(f"{self.url}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.latencies.append(time.monotonic() - start if ok else float("inf"))
                time.sleep(0.05)

    def rss(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def check(self) -> None:
        assert self.latencies, "the health poller got no answer at all"
        assert max(self.latencies) < 1.0, f"/health took {max(self.latencies):.2f} s"
        assert self.rss() - self.rss_start < 300 << 20, "server RSS grew by more than 300 MB"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    sims = SimServers(tmp_path_factory.mktemp("fuzz_server"))
    url = sims.start("--max-request-bytes", str(MAX_BODY), "--header-timeout", "2", "--body-timeout", "2",
                     "--max-connections", "1024", "--max-concurrency", "2", "--max-queue", "32")
    sims.wait_ready(url)
    monitor = Monitor(url, sims.procs[url].pid)
    with httpx.Client(timeout=30) as client:
        monitor.client = client
        yield url, monitor
    monitor.stop.set()
    monitor.thread.join(timeout=10)
    sims.stop_all()
    log = "".join(p.read_text(errors="replace") for p in sims.log_dir.glob("*.log"))
    assert "Traceback" not in log, log[-3000:]


def check_answer(response: httpx.Response) -> None:
    """The fuzzing oracle: 2xx/4xx (or 503 overload), JSON, error shape or a chat completion."""
    status = response.status_code
    assert status < 500 or (status == 503 and response.json()["error"]["code"] == "overloaded"), \
        (status, response.text[:500])
    if status == 200 and response.headers["content-type"].startswith("text/event-stream"):
        check_event_stream(response.text)
        return
    body = response.json()
    if status == 200:
        choice = body["choices"][0]
        assert body["object"] == "chat.completion" and isinstance(choice["message"]["content"], str)
        assert choice["finish_reason"] in ("stop", "length")
    else:
        error = body["error"]
        assert isinstance(error["message"], str) and error["message"] and "type" in error and "code" in error


def check_event_stream(text: str) -> None:
    """A streamed 200 (`"stream": true`): `data:` events of `chat.completion.chunk` JSON, ended by `[DONE]`."""
    events = [block for block in text.split("\n\n") if block]
    assert events and events[-1] == "data: [DONE]", text[-500:]
    finished = 0
    for event in events[:-1]:
        assert event.startswith("data: "), event[:200]
        chunk = json.loads(event.removeprefix("data: "))
        assert chunk["object"] == "chat.completion.chunk", chunk
        (choice,) = chunk["choices"]
        if choice["finish_reason"] is None:
            assert choice["delta"]["role"] == "assistant" and isinstance(choice["delta"]["content"], str)
        else:
            assert choice["finish_reason"] in ("stop", "length") and choice["delta"] == {}
            finished += 1
    assert finished >= 1, text[:500]


def _post(monitor: Monitor, url: str, content: bytes) -> httpx.Response:
    return monitor.client.post(f"{url}/v1/chat/completions", content=content,
                               headers={"Content-Type": "application/json"})


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
                      st.floats(allow_nan=False), st.text(max_size=40))
json_value = st.recursive(json_leaf, lambda kids: st.lists(kids, max_size=5) |
                          st.dictionaries(st.text(max_size=10), kids, max_size=5), max_leaves=30)
tag_soup = st.lists(st.sampled_from(["<user_reply>", "</user_reply>", "<user_status>", "1", "-1", "<", "</",
                                     ">", " ", "\n", "<reply>", "hello", "\ud7ff", "é", "<<<", "user_reply"]),
                    max_size=60).map("".join)
hostile_text = st.one_of(st.text(max_size=200), tag_soup,
                         st.tuples(tag_soup, st.integers(1, 4000)).map(lambda p: (p[0] or "<")[:20] * p[1]))
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "bogus"]),
                                 "content": st.one_of(hostile_text, json_value)})
body = st.fixed_dictionaries(
    {"model": st.one_of(st.just("user-sim"), json_value),
     "messages": st.one_of(
         st.lists(message, min_size=1, max_size=6).map(
             lambda ms: [{"role": "system", "content": PERSONA}, *ms]),
         json_value)},
    optional={"n": st.one_of(st.integers(-3, 200), json_value), "temperature": json_value,
              "top_p": json_value, "seed": json_value, "max_tokens": json_value, "stream": json_value,
              "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=6), json_value)})


@FUZZ
@given(raw=st.binary(max_size=3000))
def test_random_bytes_as_a_body(server, raw):
    url, monitor = server
    check_answer(_post(monitor, url, raw))


@FUZZ
@given(payload=body)
@example(payload={"model": "user-sim", "messages": [{"role": "system", "content": PERSONA},
                                                    {"role": "user", "content": ""}], "stream": True})
def test_hostile_json_bodies(server, payload):
    url, monitor = server
    check_answer(_post(monitor, url, json.dumps(payload).encode()))
    monitor.check()


@settings(FUZZ, max_examples=25)
@given(unit=tag_soup.filter(bool), size=st.integers(10_000, MAX_BODY))
def test_hostile_sizes(server, unit, size):
    """Tag soup up to (and past) the body limit; a body over the limit is a 413."""
    url, monitor = server
    text = (unit * (size // len(unit) + 1))[:size]
    payload = {"model": "user-sim", "messages": [{"role": "system", "content": PERSONA},
                                                 {"role": "user", "content": "Hi, Anna from Meituan here."},
                                                 {"role": "assistant", "content": text},
                                                 {"role": "user", "content": text[: size // 4]}]}
    raw = json.dumps(payload).encode()
    response = _post(monitor, url, raw)
    check_answer(response)
    if len(raw) > MAX_BODY:
        assert response.status_code == 413
    monitor.check()


def _raw_exchange(url: str, data: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        try:
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:
            pass
    return b"".join(chunks)


@settings(FUZZ, max_examples=80)
@given(data=st.one_of(st.binary(max_size=600), st.lists(st.sampled_from(
    [b"GET ", b"POST ", b"/health", b"/v1/chat/completions", b" HTTP/1.1", b"\r\n", b"Host: x", b": ",
     b"Content-Length: ", b"-1", b"99999999999", b"Transfer-Encoding: chunked", b"0\r\n\r\n", b"\x00", b"{}"]),
    max_size=25).map(b"".join)))
def test_raw_malformed_http(server, data):
    """Whatever bytes arrive, the answer is nothing (closed) or an HTTP response with a JSON body, never a 5xx."""
    url, monitor = server
    reply = _raw_exchange(url, data)
    if reply:
        head, _, payload = reply.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        assert status < 500, reply[:300]
        if payload and b"chunked" not in head.lower():
            json.loads(payload.split(b"HTTP/1.1")[0])
    monitor.check()


def test_slow_clients_and_bursts(server):
    """Drip-feeding clients and a 300-request burst at once: /health stays fast, answers stay 2xx/4xx/503."""
    url, monitor = server
    host, port = url.removeprefix("http://").split(":")
    drips = [socket.create_connection((host, int(port)), timeout=10) for _ in range(40)]
    for s in drips:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{")

    async def burst() -> list[httpx.Response]:
        payload = {"model": "user-sim", "messages": [{"role": "system", "content": PERSONA},
                                                     {"role": "user", "content": "Hello, Anna from Meituan."}]}
        limits = httpx.Limits(max_connections=300)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            return await asyncio.gather(*(client.post(f"{url}/v1/chat/completions", json=payload)
                                          for _ in range(300)))

    responses = asyncio.run(burst())
    for response in responses:
        check_answer(response)
    assert sum(r.status_code == 200 for r in responses) >= 30
    time.sleep(2.5)  # past the body deadline: the drip-feeders were answered 408 and closed
    for s in drips:
        data = s.recv(65536)
        assert data.startswith(b"HTTP/1.1 408"), data[:200]
        s.close()
    monitor.check()
