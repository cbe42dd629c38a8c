"""Test helper: scripted user-simulator servers on free loopback ports (`llm_agent.user_sim.processes`, the code
the scripts, the evaluation and the benchmarks use), logging at warning level, stopped by PID."""
from __future__ import annotations

from pathlib import Path

from llm_agent.user_sim.processes import ServerSpec, SimulatorGroup, free_port

__all__ = ["SimServers", "free_port"]


class SimServers(SimulatorGroup):
    """`SimulatorGroup` of scripted servers at log level warning, logging into `log_dir`."""

    def __init__(self, log_dir: Path) -> None:
        super().__init__(log_dir, ServerSpec(log_level="warning"))
