"""Stale vLLM CPU shared-memory segments are removed, live ones (mapped by a running process) are kept; a TP segment
another process holds is waited for, then named."""
from __future__ import annotations

import mmap
import os
import re
import subprocess
import sys
import threading
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


HOLDER = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
mapping = mmap.mmap(fd, 4096)
print("mapped", flush=True)
sys.stdin.readline()  # hold the mapping until told to exit
"""


@pytest.fixture
def held_tp_segment():
    """A TP-named segment mapped by a child process (another engine's rank): (path, process)."""
    path = cpu_shm.SHM_DIR / f"sead-test-{uuid.uuid4().hex[:8]}-[0-1]-cpushm_0"
    path.write_bytes(b"\0" * 4096)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "mapped"
        yield path, holder
    finally:
        holder.kill()
        holder.wait()
        path.unlink(missing_ok=True)


@pytest.mark.processes
@pytest.mark.skipif(not cpu_shm.SHM_DIR.is_dir(), reason="no /dev/shm on this machine")
def test_a_tp_segment_another_process_holds_is_waited_for_then_named(held_tp_segment):
    path, holder = held_tp_segment
    assert cpu_shm.busy_tp_segments().get(path.name) == [holder.pid]
    with pytest.raises(RuntimeError, match=rf"another tensor-parallel vLLM engine .*{re.escape(path.name)} by PID "
                                           rf"{holder.pid}\b"):
        cpu_shm.wait_for_tp_segments(timeout_s=0.5, poll_s=0.05)
    assert path.exists(), "a live engine's segment was removed"


@pytest.mark.processes
@pytest.mark.skipif(not cpu_shm.SHM_DIR.is_dir(), reason="no /dev/shm on this machine")
def test_the_wait_ends_when_the_holder_exits(held_tp_segment):
    path, holder = held_tp_segment
    exiter = threading.Timer(0.3, holder.stdin.close)  # the holder reads EOF and exits, as a dying worker does
    exiter.start()
    try:
        cpu_shm.wait_for_tp_segments(timeout_s=30, poll_s=0.05)
    finally:
        exiter.cancel()
    assert holder.wait(timeout=10) == 0
    assert path.name not in cpu_shm.busy_tp_segments()
