"""The start/stop scripts (and llm_agent.user_sim.processes under them) never leak the API key, never race, and never
signal a process that is not ours (issue 12, items 6, 7 and 8)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from llm_agent.user_sim.processes import free_port, start_ticks, stat_field


REPO_ROOT = Path(__file__).resolve().parents[3]
START = REPO_ROOT / "scripts" / "start_user_sims.sh"
STOP = REPO_ROOT / "scripts" / "stop_user_sims.sh"
pytestmark = pytest.mark.processes


def _env(run_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SEAD_USER_SIM_API_KEY", "API_KEY_FILE")}
    return {**env, "RUN_DIR": str(run_dir), "PYTHON": sys.executable, **extra}


def _run(script: Path, *args: str, run_dir: Path, timeout: float = 90, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], cwd=REPO_ROOT, env=_env(run_dir, **extra),
                          capture_output=True, text=True, timeout=timeout)


def _start_ticks(pid: int) -> int:
    """Field 22 of /proc/PID/stat, split after the last ')' (independent of the script's parser)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _sleeper(**popen) -> subprocess.Popen:
    return subprocess.Popen(["sleep", "120"], **popen)


def test_stat_parsing_survives_a_process_name_with_spaces_and_parentheses(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; open('/proc/self/comm', 'w').write("
                              "'a) b (c) d'); print('ready', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert Path(f"/proc/{child.pid}/comm").read_text().strip() == "a) b (c) d"
        out = [str(start_ticks(child.pid)), stat_field(child.pid, 4), stat_field(child.pid, 3)]
        assert out[:2] == [str(_start_ticks(child.pid)), str(os.getpid())] and out[2] in ("R", "S")
        naive = subprocess.run(["awk", "{print $22}", f"/proc/{child.pid}/stat"], capture_output=True, text=True)
        assert naive.stdout.strip() != out[0], "the old awk parser miscounts this name"
    finally:
        child.kill()
        child.wait()


def test_stop_never_signals_a_decoy_even_with_the_right_start_time(tmp_path):
    decoy = _sleeper()
    try:
        (tmp_path / "user_sim_5999.pid").write_text(f"{decoy.pid} {_start_ticks(decoy.pid)}\n")
        result = _run(STOP, run_dir=tmp_path, timeout=30)
        assert result.returncode == 1, result.stderr  # not verified: the file is kept and the stop fails
        assert "not a simulator on port 5999" in result.stderr and "kept" in result.stderr
        assert (tmp_path / "user_sim_5999.pid").exists()
        time.sleep(0.2)
        assert decoy.poll() is None, "the decoy must survive"
    finally:
        decoy.kill()
        decoy.wait()


def test_stop_never_signals_the_process_group(tmp_path):
    """A process that joined the instance's process group but is not its descendant survives the stop."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "llm_agent.user_sim.server", "--port", str(port),
                               "--log-level", "warning"], cwd=REPO_ROOT, process_group=0,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    bystander = _sleeper(process_group=server.pid)
    try:
        assert os.getpgid(bystander.pid) == server.pid
        (tmp_path / f"user_sim_{port}.pid").write_text(f"{server.pid} {_start_ticks(server.pid)}\n")
        result = _run(STOP, "--grace", "5", run_dir=tmp_path, timeout=60)
        assert result.returncode == 0, result.stderr
        server.wait(timeout=10)
        time.sleep(0.2)
        assert bystander.poll() is None, "a process-group signal killed a process that is not ours"
    finally:
        for proc in (server, bystander):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_two_parallel_starts_on_one_port_leave_exactly_one_healthy_instance(tmp_path):
    port = free_port()
    calls = [subprocess.Popen(["bash", str(START), "--ports", str(port), "--timeout", "60"], cwd=REPO_ROOT,
                              env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(c.wait(timeout=120), c.stderr.read()) for c in calls]
    try:
        codes = sorted(code for code, _ in results)
        assert codes == [0, 1], results
        pid = int((tmp_path / f"user_sim_{port}.pid").read_text().split()[0])
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()
        assert health["pid"] == pid and _alive(pid), "the PID file names the process that serves the port"
    finally:
        stopped = _run(STOP, run_dir=tmp_path, timeout=60)
    assert stopped.returncode == 0, stopped.stderr
    assert not _alive(pid)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)  # nothing orphaned on the port


def test_api_key_travels_by_environment_and_run_files_are_private(tmp_path):
    secret = "sk-private-0123456789"
    refused = _run(START, "--api-key", secret, run_dir=tmp_path, timeout=30)
    assert refused.returncode == 2 and "SEAD_USER_SIM_API_KEY" in refused.stderr
    key_file = tmp_path / "key"
    key_file.write_text(secret)
    key_file.chmod(0o640)
    loose = _run(START, "--api-key-file", str(key_file), run_dir=tmp_path / "run", timeout=30)
    assert loose.returncode == 2 and "chmod 600" in loose.stderr
    key_file.chmod(0o600)
    run_dir, port = tmp_path / "run", free_port()
    for how in ({"args": ["--api-key-file", str(key_file)]}, {"env": {"SEAD_USER_SIM_API_KEY": secret}}):
        started = _run(START, "--ports", str(port), "--timeout", "60", *how.get("args", []), run_dir=run_dir,
                       **how.get("env", {}))
        try:
            assert started.returncode == 0, started.stderr[-3000:]
            url = f"http://127.0.0.1:{port}"
            assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 401
            assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {secret}"},
                             timeout=5).status_code == 200
            pid = int((run_dir / f"user_sim_{port}.pid").read_text().split()[0])
            assert secret.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
            assert secret not in started.stdout + started.stderr
            for path in run_dir.iterdir():
                assert path.stat().st_mode & 0o077 == 0, f"{path.name} is readable by others"
                assert secret.encode() not in path.read_bytes(), path.name
        finally:
            assert _run(STOP, run_dir=run_dir, timeout=60).returncode == 0
