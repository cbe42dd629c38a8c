"""Scripted user simulators that an evaluation starts on loopback for itself and stops by PID.

`LocalSimulators(n, scenario, log_dir)` launches `python -m llm_agent.user_sim.server --backend scripted` n times
on free 127.0.0.1 ports through `llm_agent.user_sim.processes.SimulatorGroup`, waits until each is healthy, and on
`stop()` (or leaving the `with` block) stops exactly the processes it started. On Linux each server also gets
SIGTERM from the kernel when the evaluating process dies (even by SIGKILL), so none is left behind.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

from llm_agent.user_sim.processes import ServerSpec, SimulatorGroup, free_port

__all__ = ["LocalSimulators", "free_port"]


class LocalSimulators:
    """N scripted simulator servers owned by this process (see the module docstring)."""

    def __init__(self, n: int, scenario: str, log_dir: str | Path, seed: int = 0,
                 health_timeout_s: float = 60.0) -> None:
        if n < 1:
            raise ValueError(f"need at least one simulator, got {n}")
        self.n, self.health_timeout_s = n, health_timeout_s
        self.group = SimulatorGroup(log_dir, ServerSpec(scenario=str(scenario), seed=seed, log_level="warning"))

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        """The running servers' processes by base URL."""
        return self.group.procs

    @property
    def urls(self) -> list[str]:
        """The base URLs of the running servers."""
        return list(self.group.procs)

    def start(self) -> list[str]:
        """Start the servers and wait until all are healthy; on failure stop those started and raise."""
        return self.group.start_many(self.n, timeout_s=self.health_timeout_s)

    def stop(self) -> None:
        """Stop exactly the processes this object started."""
        self.group.stop_all()

    def __enter__(self) -> LocalSimulators:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
