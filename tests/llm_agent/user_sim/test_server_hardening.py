"""The simulator server under hostile requests, over real loopback HTTP (issue 12, items 1, 3, 5 and 6).

Each test starts its own scripted server subprocess with tight limits and stops it by PID.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from llm_agent.scenario import DEFAULT_SCENARIO_PATH, load_scenario

from tests.helpers.repo import REPO
from tests.helpers.sim_servers import SimServers, free_port
from tests.helpers.profiles import profile3

pytestmark = pytest.mark.processes
SCENARIO = load_scenario(DEFAULT_SCENARIO_PATH)
PERSONA = SCENARIO.render_user_prompt(profile3(2, 2, 2, behaviors=()))


@pytest.fixture
def servers(tmp_path):
    sims = SimServers(tmp_path)
    yield sims
    sims.stop_all()


def _log_text(sims: SimServers) -> str:
    return "".join(p.read_text(errors="replace") for p in sims.log_dir.glob("server_*.log"))


def _body(assistant: str) -> dict:
    return {"model": "user-sim", "messages": [
        {"role": "system", "content": PERSONA}, {"role": "user", "content": "Hello, this is Anna from Meituan."},
        {"role": "assistant", "content": assistant}, {"role": "user", "content": "Do you have a minute?"}]}


def _health_latencies(url: str, stop: threading.Event, out: list[float]) -> None:
    while not stop.is_set():
        start = time.monotonic()
        try:
            httpx.get(f"{url}/health", timeout=5).raise_for_status()
            out.append(time.monotonic() - start)
        except httpx.HTTPError:
            out.append(float("inf"))
        time.sleep(0.05)


def test_health_answers_within_a_second_while_hostile_bodies_are_parsed(servers):
    """`"<user_reply>" * 80000` (960 KB) froze the server for minutes (quadratic regex holding the GIL)."""
    url = servers.start()
    servers.wait_ready(url)
    stop, latencies = threading.Event(), []
    poller = threading.Thread(target=_health_latencies, args=(url, stop, latencies))
    poller.start()
    try:
        for hostile in ("<user_reply>" * 80_000, "<" + " " * 900_000, "</user_reply" * 70_000):
            start = time.monotonic()
            r = httpx.post(f"{url}/v1/chat/completions", json=_body(hostile), timeout=60)
            assert r.status_code == 200 and r.json()["choices"], r.text[:300]
            assert time.monotonic() - start < 10
    finally:
        stop.set()
        poller.join()
    assert latencies and max(latencies) < 1.0, max(latencies)


def test_slow_partial_requests_are_cut_off_and_do_not_exhaust_the_server(servers):
    """Idle partial connections stayed open forever; now the header deadline closes them with a JSON 408."""
    url = servers.start("--header-timeout", "1", "--body-timeout", "1", "--max-connections", "40")
    servers.wait_ready(url)
    port = int(url.rsplit(":", 1)[1])
    socks = []
    for i in range(120):  # more than the connection cap: the surplus is closed at once
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" if i % 2 else b"GET /hea")
        socks.append(s)
    start = time.monotonic()
    assert httpx.get(f"{url}/health", timeout=3).status_code in (200,)  # a fresh client still gets through
    assert time.monotonic() - start < 1.0
    time.sleep(2.0)
    answered = 0
    for s in socks:  # by now the server has closed every partial connection: a 408 then EOF, or a reset (shed)
        try:
            data = s.recv(65536)
        except ConnectionResetError:
            data = None
        if data:
            head, _, body = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408") and json.loads(body)["error"]["code"] == "request_timeout"
            answered += 1
            assert s.recv(65536) == b""
        s.close()
    assert answered >= 30
    # a body that never completes: 408 JSON from the app once --body-timeout passes
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"model\": ")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), data[:200]
        assert json.loads(body)["error"]["code"] == "request_timeout"
    assert httpx.get(f"{url}/health", timeout=3).status_code == 200
    assert len(_log_text(servers)) < 200_000


def test_disconnect_is_not_an_internal_error_and_malformed_http_gets_json(servers):
    url = servers.start()
    servers.wait_ready(url)
    port = int(url.rsplit(":", 1)[1])
    for _ in range(5):  # the client hangs up halfway through its body
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n{\"mo")
    for raw in (b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nBad Header\r\n\r\n",
                b"POST /v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(raw)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head.lower(), data[:300]
        assert json.loads(body)["error"]["code"] == "invalid_http"
    time.sleep(0.5)
    log = _log_text(servers)
    assert "Traceback" not in log and " 500" not in log, log[-2000:]
    assert httpx.get(f"{url}/health", timeout=3).status_code == 200


def test_overload_is_a_json_503_and_too_many_messages_a_400(servers):
    url = servers.start("--max-concurrency", "1", "--max-queue", "1", "--max-messages", "8",
                        "--inject-latency-ms", "300")
    servers.wait_ready(url)
    many = _body("ok")
    many["messages"] += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "hi"}] * 4
    r = httpx.post(f"{url}/v1/chat/completions", json=many, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    statuses = []

    def one() -> None:
        statuses.append(httpx.post(f"{url}/v1/chat/completions", json=_body("ok"), timeout=30))

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in statuses)
    assert set(codes) <= {200, 503} and 200 in codes, codes
    for r in statuses:
        if r.status_code == 503:
            assert r.json()["error"]["code"] == "overloaded" and r.headers["retry-after"]


def _run_server(args: list[str], env: dict[str, str], tmp_path: Path) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = tmp_path / f"server_{port}.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "llm_agent.user_sim.server", "--port", str(port), *args],
                                cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **env})
    return proc, f"http://127.0.0.1:{port}", log


def test_api_key_never_on_the_command_line_and_its_file_must_be_private(tmp_path):
    secret = "sk-very-secret-123"
    proc, _, log = _run_server(["--api-key", secret], {}, tmp_path)
    assert proc.wait(timeout=30) != 0
    text = log.read_text()
    assert "/proc/PID/cmdline" in text and "SEAD_USER_SIM_API_KEY" in text and secret not in text
    key_file = tmp_path / "key"
    key_file.write_text(secret + "\n")
    key_file.chmod(0o644)
    proc, _, log = _run_server(["--api-key-file", str(key_file)], {}, tmp_path)
    assert proc.wait(timeout=30) != 0 and "chmod 600" in log.read_text()
    key_file.chmod(0o600)
    for args, env in ((["--api-key-file", str(key_file)], {}), ([], {"SEAD_USER_SIM_API_KEY": secret})):
        proc, url, log = _run_server([*args, "--log-level", "debug"], env, tmp_path)
        try:
            sims = SimServers(tmp_path)
            sims.procs[url] = proc
            sims.wait_ready(url)
            assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 401
            ok = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {secret}"}, timeout=5)
            assert ok.status_code == 200
            assert secret.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        finally:
            proc.terminate()
            proc.wait(timeout=15)
        assert secret not in log.read_text()
