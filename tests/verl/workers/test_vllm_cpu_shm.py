"""Stale vLLM CPU shared-memory segments are removed, live ones (mapped by a running process) are kept."""
from __future__ import annotations

import mmap
import os
import uuid

import pytest

from verl.workers.rollout.vllm_rollout import cpu_shm


@pytest.mark.skipif(not cpu_shm.SHM_DIR.is_dir(), reason="no /dev/shm on this machine")
def test_only_segments_no_process_maps_are_removed():
    tag = uuid.uuid4().hex[:8]
    stale, live, other = (cpu_shm.SHM_DIR / name for name in
                          (f"sead-test-{tag}-[0-1]-cpushm", f"sead-test-{tag}-live-cpushm", f"sead-test-{tag}-other"))
    for path in (stale, live, other):
        path.write_bytes(b"\0" * 4096)
    fd = os.open(live, os.O_RDWR)
    mapping = mmap.mmap(fd, 4096)  # this process maps it: a live engine's segment
    try:
        removed = cpu_shm.remove_stale_segments()
        assert stale.name in removed and not stale.exists()
        assert live.exists() and live.name not in removed
        assert other.exists(), "a segment that is not vLLM's was touched"
    finally:
        mapping.close()
        os.close(fd)
        for path in (stale, live, other):
            path.unlink(missing_ok=True)
