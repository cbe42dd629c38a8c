"""What every benchmark writes beside its figures: the machine it ran on and its settings, as one JSON file."""
from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path
from typing import Any

__all__ = ["machine", "write_result"]


def machine(**extra: Any) -> dict:
    """Where the benchmark ran: CPU model, cores, Python, platform and the 1-minute load average now, plus
    `extra` (torch threads and version, say)."""
    cpuinfo = Path("/proc/cpuinfo")
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if cpuinfo.exists() else ""
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
            **extra, "load_avg_1m_at_end": os.getloadavg()[0]}


def write_result(args: argparse.Namespace, load_at_start: float, machine_extra: dict | None = None,
                 **sections: Any) -> dict:
    """Write {config (the parsed arguments), machine (with the load average at the start), **sections} to
    `args.out` as JSON and return it."""
    result = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "machine": {**machine(**(machine_extra or {})), "load_avg_1m_at_start": load_at_start}, **sections}
    args.out.write_text(json.dumps(result, indent=2))
    return result
