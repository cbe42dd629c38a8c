"""The simulator server against hostile field values and slow-body reconnecting clients (issue 29, items 2 and 6)."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from llm_agent.scenario import DEFAULT_SCENARIO_PATH, load_scenario
from llm_agent.user_sim.server.app import ServerConfig, build_app
from llm_agent.user_sim.server.scripted import ScriptedPersonaBackend

from tests.helpers.sim_servers import SimServers
from tests.helpers.profiles import profile3

SCENARIO = load_scenario(DEFAULT_SCENARIO_PATH)
MESSAGES = [{"role": "system", "content": SCENARIO.render_user_prompt(profile3(2, 2, 2))},
            {"role": "user", "content": "Hello."}]


@pytest.mark.parametrize("field, value", [("seed", "\ud800"), ("seed", ["\udfff" * 3]), ("n", "\ud800"),
                                          ("stop", [1, "\ud800"]), ("max_tokens", "x\udc00")])
def test_lone_surrogates_in_any_field_get_a_clean_json_400(field, value, caplog):
    from fastapi.testclient import TestClient

    body = json.dumps({"model": "user-sim", "messages": MESSAGES, field: value}).encode()  # "\\ud800" escapes
    with TestClient(build_app(ScriptedPersonaBackend(SCENARIO), ServerConfig()), raise_server_exceptions=False) as tc:
        r = tc.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text[:300]
    error = r.json()["error"]
    assert error["param"] == field and error["message"].encode("utf-8")
    assert "Traceback" not in caplog.text


class SlowBodies:
    """`n` connections that send a request's headers, then its body a byte every 0.1 s, reconnecting as soon as
    the server closes one (the attack of issue 29 item 6)."""

    HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\n\r\n")

    def __init__(self, port: int, n: int) -> None:
        self.port, self.n = port, n
        self.reconnects = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _connect(self) -> socket.socket | None:
        try:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=1)
            s.sendall(self.HEAD)
            s.setblocking(False)
            return s
        except OSError:
            return None

    @staticmethod
    def _still_open(s: socket.socket) -> bool:
        """True when the server neither answered nor closed `s`; then one more body byte is sent."""
        try:
            s.recv(65536)  # an answer (408, 503) or EOF: this connection is over
            return False
        except BlockingIOError:
            try:
                s.send(b" ")
                return True
            except OSError:
                return False
        except OSError:
            return False

    def _run(self) -> None:
        socks = [self._connect() for _ in range(self.n)]
        while not self.stop.wait(0.1):
            for i, s in enumerate(socks):
                if s is not None and self._still_open(s):
                    continue
                if s is not None:
                    s.close()
                socks[i] = self._connect()
                self.reconnects += 1
        for s in socks:
            if s is not None:
                s.close()


@pytest.mark.processes
def test_health_answers_while_slow_body_clients_keep_reconnecting_at_the_connection_cap(tmp_path):
    sims = SimServers(tmp_path)
    try:
        url = sims.start("--max-connections", "30")  # the default body deadline
        sims.wait_ready(url)
        attack = SlowBodies(int(url.rsplit(":", 1)[1]), 45)
        attack.thread.start()
        time.sleep(1.0)  # the attackers fill the cap
        ok = 0
        for _ in range(20):
            try:
                ok += httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        attack.stop.set()
        attack.thread.join(timeout=10)
    finally:
        sims.stop_all()
    assert attack.reconnects > 0, "the attack never reached the connection cap"
    assert ok >= 18, f"only {ok} of 20 /health polls answered"
