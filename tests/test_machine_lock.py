"""The machine lock the tensor-parallel vLLM tests hold (tests/helpers/machine_lock.py) excludes another process
until its holder lets go."""
from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from tests.helpers.machine_lock import machine_lock

HOLDER = """
import sys
from tests.helpers.machine_lock import machine_lock
with machine_lock("sead-test", sys.argv[1]):
    print("held", flush=True)
    sys.stdin.readline()
"""


@pytest.mark.processes
def test_a_second_process_waits_for_the_holder(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    acquired = threading.Event()

    def take() -> None:
        with machine_lock("sead-test", tmp_path):
            acquired.set()

    try:
        assert holder.stdout.readline().strip() == "held"
        taker = threading.Thread(target=take, daemon=True)
        taker.start()
        assert not acquired.wait(timeout=0.5), "the lock was taken while another process held it"
        holder.stdin.close()  # the holder leaves its block and exits
        assert acquired.wait(timeout=30), "the lock was not taken after its holder let go"
        taker.join(timeout=5)
    finally:
        holder.kill()
        holder.wait()
