"""llm_agent.user_sim.processes, the one start/await/stop code of every simulator: PID records, readiness, signals
that reach the server, verified stops that spare other processes and reap descendants."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llm_agent.user_sim.processes import (ProcessId, ServerSpec, SimulatorGroup, SimulatorStartError, descendants,
                                          is_our_simulator, launch, listens_on, port_in_use, stop_process,
                                          wait_until_ready)


def _signals_blocked(pid: int) -> int:
    """The SigBlk mask of PID, read from /proc/PID/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigBlk:"):
            return int(line.split()[1], 16)
    raise AssertionError("no SigBlk line")


def test_process_records_parse_and_never_verify_without_a_start_time():
    assert ProcessId.parse("123 456\n") == ProcessId(123, 456)
    assert ProcessId.parse("123") == ProcessId(123, 0)
    assert ProcessId.parse("123 x") == ProcessId(123, 0)
    for bad in ("", "x 1", "0 5", "-4 5"):
        assert ProcessId.parse(bad) is None, bad
    me = ProcessId.of(os.getpid())
    assert me is not None and me.alive() and me.mine() and ProcessId.parse(me.record()) == me
    assert not ProcessId(os.getpid(), 0).alive() and not ProcessId(os.getpid(), me.start_ticks + 1).alive()


def test_listens_on_names_the_process_holding_the_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        assert not port_in_use(port) and not listens_on(os.getpid(), port)  # bound, not listening
        sock.listen()
        assert port_in_use(port) and listens_on(os.getpid(), port)
        assert not listens_on(os.getppid(), port)
    assert not port_in_use(port)


@pytest.mark.processes
def test_a_server_started_while_signals_are_held_back_still_stops_on_sigterm(tmp_path):
    """The instances CLI blocks SIGTERM while it records a PID; the server must not inherit that mask (it did: the
    stop then waited out its 20 s grace and used SIGKILL)."""
    group = SimulatorGroup(tmp_path)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        url = group.start()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    try:
        group.wait_ready(url, timeout_s=60)
        proc = group.procs[url]
        port = int(url.rsplit(":", 1)[1])
        ident = ProcessId.of(proc.pid)
        assert _signals_blocked(proc.pid) == 0
        assert os.getpgid(proc.pid) == proc.pid, "each server leads its own session"
        assert is_our_simulator(ident, port) and not is_our_simulator(ident, port + 1)
        assert listens_on(proc.pid, port)
        messages: list[str] = []
        started = time.monotonic()
        assert stop_process(ident, grace_s=20, proc=proc, log=messages.append)
        assert time.monotonic() - started < 10 and messages == [], messages  # TERM did it, no KILL
        assert proc.returncode is not None and not ident.alive()
    finally:
        group.stop_all()


@pytest.mark.processes
def test_a_decoy_with_the_right_start_time_is_not_a_simulator():
    decoy = subprocess.Popen(["sleep", "60"])
    try:
        ident = ProcessId.of(decoy.pid)
        assert ident.alive() and ident.mine() and not is_our_simulator(ident, 5000)
    finally:
        decoy.kill()
        decoy.wait()


@pytest.mark.processes
def test_stop_process_kills_the_descendants_it_found_and_nothing_else(tmp_path):
    parent = subprocess.Popen(["bash", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        child = ProcessId.of(int(parent.stdout.readline()))
        assert child in descendants(parent.pid) and ProcessId.of(bystander.pid) not in descendants(parent.pid)
        assert stop_process(ProcessId.of(parent.pid), grace_s=5, proc=parent, log=lambda _: None)
        deadline = time.monotonic() + 5
        while child.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not child.alive(), "the orphaned child was left running"
        assert bystander.poll() is None
    finally:
        for proc in (parent, bystander):
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.mark.processes
def test_an_instance_that_exits_fails_the_wait_with_its_log(tmp_path):
    log = tmp_path / "dead.log"
    proc = launch([sys.executable, "-c", "import sys; print('no scenario here'); sys.exit(3)"], os.environ, log,
                  header="starting")
    with pytest.raises(SimulatorStartError, match="exited before becoming healthy") as err:
        wait_until_ready([(1, proc, log)], timeout_s=30)
    assert err.value.log_tail().splitlines() == ["starting", "no scenario here"]
    assert log.stat().st_mode & 0o077 == 0


def test_server_specs_build_each_backends_command_and_environment():
    vllm = ServerSpec(backend="vllm", model="/m", seed=7, served_model_name="sim", tp=2, vllm_python="/v/python",
                      extra_args=("--enforce-eager",))
    assert vllm.command(5001) == ["/v/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m",
                                  "--served-model-name", "sim", "--host", "127.0.0.1", "--port", "5001",
                                  "--tensor-parallel-size", "2", "--max-model-len", "8192",
                                  "--gpu-memory-utilization", "0.9", "--seed", "7", "--enforce-eager"]
    env = vllm.environment({"TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1", "HOME": "/h"}, "6,7", "k")
    assert env == {"HOME": "/h", "CUDA_VISIBLE_DEVICES": "6,7", "SEAD_USER_SIM_API_KEY": "k", "VLLM_API_KEY": "k"}
    scripted = ServerSpec(scenario="/s.yaml", python="/p", log_level="warning")
    assert scripted.command(1) == ["/p", "-m", "llm_agent.user_sim.server", "--backend", "scripted", "--host",
                                   "127.0.0.1", "--port", "1", "--scenario", "/s.yaml", "--log-level", "warning"]
    assert scripted.environment({"OMP_NUM_THREADS": "1"}) == {"OMP_NUM_THREADS": "1"}
    with pytest.raises(ValueError, match="needs a model"):
        ServerSpec(backend="hf")
    with pytest.raises(ValueError, match="vllm, hf or scripted"):
        ServerSpec(backend="sglang", model="/m")
