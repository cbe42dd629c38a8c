"""utils.check_simulators: exit 0 when every simulator answers /health, 2 naming the dead ones by host:port; a URL
carrying credentials (without repeating them) and a timeout that is not a finite positive number are refused."""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from utils.check_simulators import main

from tests.helpers.sim_servers import free_port


class _Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture()
def alive_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def test_all_answering_exits_0(alive_url, capsys):
    assert main([alive_url, "--timeout", "5"]) == 0
    assert alive_url.split("//")[1] in capsys.readouterr().out


def test_dead_ones_are_named_by_host_and_port(alive_url, capsys):
    dead_host = f"127.0.0.1:{free_port()}"
    assert main([f"{alive_url}/v1/,http://{dead_host}", "--timeout", "2"]) == 2
    err = capsys.readouterr().err
    assert dead_host in err and alive_url.split("//")[1] not in err


def test_a_url_carrying_credentials_is_refused_before_any_request(alive_url, capsys):
    host = alive_url.split("//")[1]
    with pytest.raises(SystemExit) as exc:
        main([f"{alive_url},http://ops:hunter2-secret@{host}/x", "--timeout", "2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "SEAD_USER_SIM_API_KEY" in err and "hunter2" not in err and "ops:" not in err


@pytest.mark.parametrize("timeout", ["nan", "inf", "-1", "0", "soon"])
def test_a_timeout_that_is_not_finite_and_positive_is_refused(alive_url, timeout, capsys):
    with pytest.raises(SystemExit) as exc:
        main([alive_url, "--timeout", timeout])
    assert exc.value.code == 2
    assert "--timeout" in capsys.readouterr().err
