"""Scripted user simulators that an evaluation starts on loopback for itself and stops by PID.

`LocalSimulators(n, scenario, log_dir)` launches `python -m llm_agent.user_sim.server --backend scripted` n times
on free 127.0.0.1 ports, waits until each answers `GET /health`, and on `stop()` (or leaving the `with` block)
terminates exactly the processes it started, killing any that do not exit within 5 s. On Linux each server also
gets SIGTERM from the kernel when the evaluating process dies (even by SIGKILL), so none is left behind.
"""
from __future__ import annotations

import ctypes
import logging
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import httpx

logger = logging.getLogger(__name__)

__all__ = ["LocalSimulators", "free_port"]

REPO_ROOT = Path(__file__).resolve().parents[2]
_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn asking the kernel to SIGTERM the child when its parent dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    return lambda: libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


class LocalSimulators:
    """N scripted simulator servers owned by this process (see the module docstring)."""

    def __init__(self, n: int, scenario: str, log_dir: str | Path, seed: int = 0,
                 health_timeout_s: float = 60.0) -> None:
        if n < 1:
            raise ValueError(f"need at least one simulator, got {n}")
        self.n, self.scenario, self.seed = n, str(scenario), seed
        self.log_dir = Path(log_dir)
        self.health_timeout_s = health_timeout_s
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def urls(self) -> list[str]:
        """The base URLs of the running servers."""
        return list(self.procs)

    def start(self) -> list[str]:
        """Start the servers and wait until all are healthy; on failure stop those started and raise."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for _ in range(self.n):
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                with open(self.log_dir / f"user_sim_{port}.log", "w") as log:
                    cmd = [sys.executable, "-m", "llm_agent.user_sim.server", "--backend", "scripted",
                           "--port", str(port), "--scenario", self.scenario, "--seed", str(self.seed),
                           "--log-level", "warning"]
                    self.procs[url] = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                                       preexec_fn=_die_with_parent())
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        logger.info("started %d scripted simulators: %s (PIDs %s)", self.n, ",".join(self.urls),
                    [p.pid for p in self.procs.values()])
        return self.urls

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.health_timeout_s
        for url, proc in self.procs.items():
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"simulator {url} exited with status {proc.returncode}; see "
                                       f"{self.log_dir / ('user_sim_' + url.rsplit(':', 1)[1] + '.log')}")
                try:
                    if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"simulator {url} not healthy after {self.health_timeout_s}s; see {self.log_dir}")
                time.sleep(0.1)

    def stop(self) -> None:
        """Terminate exactly the processes this object started (by PID); kill those still alive after 5 s."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for url, proc in self.procs.items():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                logger.warning("simulator %s (PID %d) ignored SIGTERM; killing it", url, proc.pid)
                proc.kill()
                proc.wait(timeout=5)
        if self.procs:
            logger.info("stopped simulators (PIDs %s)", [p.pid for p in self.procs.values()])

    def __enter__(self) -> "LocalSimulators":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
