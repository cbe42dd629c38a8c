"""bench/gpu_check.sh in the modes CI can run: it builds the carried wheels, then its dry run and its CPU smoke
mode run as on the GPU machine (no Ray, no vLLM, the carried packages from the wheels only) and write one JSON."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GPU_TESTS = {"test_packed_attention_cuda.py", "test_actor_cuda.py", "test_vllm_cuda.py"}

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # 53 s measured: make test-extended (CI), not make test


def _check(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PY": sys.executable, "WHEELS": str(tmp_path / "wheels"), "BUILD_PY": sys.executable,
            **env}
    return subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), *args], cwd=tmp_path, env=full,
                          capture_output=True, text=True, timeout=600)


def test_wheels_dry_run_and_cpu_smoke(tmp_path):
    missing = _check(tmp_path, "--dry-run", OUT=str(tmp_path / "none"))
    assert missing.returncode == 2 and "--build-wheels" in missing.stderr  # no wheels yet: says how to get them
    built = _check(tmp_path, "--build-wheels")
    assert built.returncode == 0, built.stderr
    wheels = list((tmp_path / "wheels").glob("*.whl"))
    assert len(wheels) == 11 and all(w.name.endswith("-none-any.whl") for w in wheels)
    assert sum(w.stat().st_size for w in wheels) < 8 * 2**20  # far below the 64 MiB that may travel

    done = _check(tmp_path, "--dry-run", OUT=str(tmp_path / "dry"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    dry = json.loads((tmp_path / "dry" / "gpu_check.json").read_text())
    sections = dry["sections"]
    assert dry["mode"] == "dry-run" and dry["summary"]["ok"]
    imports = sections["imports"]
    assert imports["ok"] and not imports["available"]["ray"] and not imports["available"]["vllm"]
    for package in ("hydra", "omegaconf", "tensordict", "cloudpickle"):  # from the wheels, not this environment
        assert ".venv" not in imports["origins"][package] and sys.prefix not in imports["origins"][package], package
    collected = {line.split("::")[0].rsplit("/", 1)[-1] for line in sections["gpu_tests"]["collected"]}
    assert collected == GPU_TESTS
    planned = sections["bench"]["planned_mib"]
    assert 20_000 < planned["packed"]["update"] < 80_000 and planned["padded"]["update"] > 0

    done = _check(tmp_path, "--cpu-smoke", OUT=str(tmp_path / "smoke"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    smoke = json.loads((tmp_path / "smoke" / "gpu_check.json").read_text())
    assert smoke["mode"] == "cpu-smoke" and smoke["summary"]["ok"]
    assert smoke["summary"]["gpu_tests"] == {"passed": 0, "failed": 0, "skipped": 6}  # no CUDA here
    for setup in ("packed", "padded"):
        row = smoke["sections"]["bench"]["setups"][setup]
        assert row["tokens_per_s"] > 0 and row["planned_update_mib"] > 0 and row["update_s"] > 0
        assert row["init_s"] > 0 and row["log_prob_s"] > 0
    assert all(section["seconds"] >= 0 for section in smoke["sections"].values())
