"""Test helper: scripted user-simulator servers as subprocesses on free loopback ports, stopped by PID."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.helpers.repo import REPO



def free_port() -> int:
    """A port nothing listens on right now (bound and released on loopback)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SimServers:
    """Starts simulator servers as subprocesses on free ports, and stops each one by its PID."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, *flags: str, port: int | None = None, env: dict[str, str] | None = None) -> str:
        """Launch one scripted server (not yet waited for; `env` adds environment variables) and return its URL."""
        port = port or free_port()
        url = f"http://127.0.0.1:{port}"
        log = open(self.log_dir / f"server_{port}_{len(self.procs)}.log", "w")
        cmd = [sys.executable, "-m", "llm_agent.user_sim.server", "--backend", "scripted", "--port", str(port),
               "--log-level", "warning", *flags]
        self.procs[url] = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                           env={**os.environ, **(env or {})})
        log.close()
        return url

    def wait_ready(self, *urls: str, timeout_s: float = 60.0) -> None:
        """Block until every url answers GET /health, or fail naming the server and its log."""
        deadline = time.monotonic() + timeout_s
        for url in urls:
            while True:
                if self.procs[url].poll() is not None:
                    raise RuntimeError(f"simulator {url} exited with {self.procs[url].returncode}; see {self.log_dir}")
                try:
                    if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"simulator {url} not healthy after {timeout_s}s; see {self.log_dir}")
                time.sleep(0.1)

    def kill(self, url: str) -> None:
        """SIGKILL the server behind `url` (by PID) and reap it."""
        proc = self.procs[url]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def stop_all(self) -> None:
        """Terminate every server this object started (by PID), killing those that do not stop in 5 s."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
