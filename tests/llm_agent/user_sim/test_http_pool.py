"""SimulatorHTTP against a raw HTTP/1.1 server on loopback: the connection bound, keep-alive reuse, and the reply
size cap (declared length and chunked), through the pool and through UserSimClient."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest

from llm_agent.user_sim.client import TurnRequest, TurnFailure, UserSimClient
from llm_agent.user_sim.client.http_pool import ResponseTooLarge, SimulatorHTTP

CAP = 4096


class RawServer:
    """A keep-alive HTTP/1.1 server on its own loop thread that counts the connections it accepted.

    GET /ok waits 20 ms, then answers a small JSON body; /v1/models names one model; POST
    /v1/chat/completions answers a body of CAP + 1 bytes with a Content-Length; GET /chunked answers CAP * 4
    bytes in chunks of 512 without one.
    """

    def __init__(self) -> None:
        self.connections = 0
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        started.wait(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        started.set()
        self.loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                method, path, _ = lines[0].split(" ")
                length = next((int(h.split(":")[1]) for h in lines[1:] if h.lower().startswith("content-length")), 0)
                await reader.readexactly(length)
                if path == "/chunked":
                    writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                    for _ in range(CAP * 4 // 512):
                        writer.write(b"200\r\n" + b"x" * 512 + b"\r\n")
                    writer.write(b"0\r\n\r\n")
                else:
                    if path == "/ok":
                        await asyncio.sleep(0.02)
                        body = b'{"ok": true}'
                    elif path == "/v1/models":
                        body = json.dumps({"data": [{"id": "m"}]}).encode()
                    else:
                        body = b"y" * (CAP + 1)
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                                 % len(body) + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def raw_server():
    server = RawServer()
    yield server
    server.close()


def test_concurrent_requests_share_at_most_max_connections_kept_alive(raw_server):
    async def main() -> list[int]:
        http = SimulatorHTTP(max_connections=10, timeout_s=10, headers={})
        try:
            first = await asyncio.gather(*(http.get(f"{raw_server.url}/ok") for _ in range(100)))
            second = await asyncio.gather(*(http.get(f"{raw_server.url}/ok") for _ in range(30)))
        finally:
            await http.aclose()
        return [r.status_code for r in first + second] + [first[0].json()["ok"]]

    statuses = asyncio.run(main())
    assert statuses[:-1] == [200] * 130 and statuses[-1] is True
    assert raw_server.connections == 10  # 130 requests over the same 10 kept-alive connections


@pytest.mark.parametrize("path", ["/too-long", "/chunked"])
def test_a_reply_over_the_size_cap_is_refused(raw_server, path):
    async def main() -> None:
        http = SimulatorHTTP(max_connections=2, timeout_s=10, headers={}, max_response_bytes=CAP)
        try:
            with pytest.raises(ResponseTooLarge, match="over the cap"):
                if path == "/chunked":
                    await http.get(f"{raw_server.url}{path}")
                else:
                    await http.post(f"{raw_server.url}{path}", json={})
            assert (await http.get(f"{raw_server.url}/ok")).status_code == 200  # the pool still works
        finally:
            await http.aclose()

    asyncio.run(main())


def test_the_client_counts_an_oversized_reply_as_garbage(raw_server, monkeypatch):
    monkeypatch.setattr("llm_agent.user_sim.client.http_pool.MAX_RESPONSE_BYTES", CAP)
    request = TurnRequest("d0", [{"role": "system", "content": "persona"}, {"role": "user", "content": "hi"}])
    with UserSimClient(raw_server.url, max_attempts=2, timeout_s=5, backoff_s=0.01) as client:
        result = client.complete([request])[0]
        stats = client.stats()
    name = raw_server.url.removeprefix("http://")
    assert isinstance(result, TurnFailure) and result.attempts == 2
    assert all("over the cap" in e for e in result.errors)
    assert stats[f"user_sim/{name}/failures_garbage"] == 2
