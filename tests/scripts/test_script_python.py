"""The scripts find the project's python themselves and say which (scripts/python_env.sh), and main.sh's dry run and
plan speak plainly: a missing model path is not something to download, a tiny model's size has a unit, and a step count
(trainer.total_training_steps) the checkpoints already reach is called out before anything starts.

Before: with a `python` on PATH that lacked the project (no activated .venv), `MODEL_PATH=... bash scripts/main.sh
--plan` checked the scenario and died with `ModuleNotFoundError: No module named 'omegaconf'`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

REPO = Path(__file__).resolve().parents[2]
SETTINGS = ("PYTHON", "PRESET", "MODEL_PATH", "OUTPUT_DIR", "STEPS", "SCENARIO", "USER_SIM_URLS", "USER_SIM_MODEL",
            "PRINT_CONFIG_ONLY", "EXPERIMENT", "SEAD_REPO_ROOT")
TINY_CONFIG = {"model_type": "qwen2", "vocab_size": 2048, "hidden_size": 128, "intermediate_size": 256,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
               "tie_word_embeddings": True}


def _bare_python(directory: Path) -> Path:
    """A `python` that lacks the project's packages (this interpreter without its site-packages)."""
    directory.mkdir(parents=True, exist_ok=True)
    wrapper = directory / "python"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


def _env(path_first: Path | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and not (Path(p).parent / "pyvenv.cfg").exists()]
    env["PATH"] = os.pathsep.join(([str(path_first)] if path_first else []) + path)
    env.update(extra)
    return env


def _find(tmp_path: Path, path_first: Path | None, *args: str, **extra: str) -> subprocess.CompletedProcess:
    script = f'source "{REPO}/scripts/python_env.sh" && sead_find_python {" ".join(args)} && echo "PYTHON=$PYTHON"'
    return subprocess.run(["bash", "-c", script], cwd=tmp_path, env=_env(path_first, **extra), capture_output=True,
                          text=True, timeout=120)


def _fake_checkout(root: Path, *envs: str) -> Path:
    """A checkout whose environments `envs` (.venv, .venv-vllm) hold a python with the project (this one)."""
    for name in envs:
        (root / name / "bin").mkdir(parents=True)
        (root / name / "bin" / "python").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
        (root / name / "bin" / "python").chmod(0o755)
    return root


def test_the_lookup_prefers_a_python_with_the_project_and_says_which(tmp_path):
    bare = _bare_python(tmp_path / "bare")
    checkout = _fake_checkout(tmp_path / "checkout", ".venv", ".venv-vllm")
    done = _find(tmp_path, bare.parent, SEAD_REPO_ROOT=str(checkout))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"PYTHON={checkout}/.venv/bin/python"
    assert f"python: {checkout}/.venv/bin/python (the checkout's .venv; `python` on PATH ({bare}) lacks" in done.stderr
    vllm = _find(tmp_path, bare.parent, "vllm", SEAD_REPO_ROOT=str(checkout))  # the rehearsal's choice
    assert vllm.stdout.strip() == f"PYTHON={checkout}/.venv-vllm/bin/python"
    activated = _find(tmp_path, Path(sys.executable).parent, SEAD_REPO_ROOT=str(checkout))  # `. .venv/bin/activate`
    assert activated.stdout.strip() == "PYTHON=python" and f"python: {Path(sys.executable).parent}" in activated.stderr
    given = _find(tmp_path, bare.parent, SEAD_REPO_ROOT=str(checkout), PYTHON="envs/py", SEAD_CALLER_DIR="/caller")
    assert given.stdout.strip() == "PYTHON=/caller/envs/py" and given.stderr == ""  # the user's own wins, silently


def test_without_any_the_lookup_says_how_to_make_one(tmp_path):
    bare = _bare_python(tmp_path / "bare")
    done = _find(tmp_path, bare.parent, SEAD_REPO_ROOT=str(tmp_path / "empty_checkout"))
    assert done.returncode == 2 and "PYTHON=" not in done.stdout
    assert "run `make install` (then `. .venv/bin/activate`), or set PYTHON=" in done.stderr


@pytest.mark.skipif(not (REPO / ".venv" / "bin" / "python").exists(), reason="needs the checkout's .venv")
def test_main_sh_plan_runs_without_activation_and_prints_a_tiny_model_in_millions(tmp_path):
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_CONFIG))
    bare = _bare_python(tmp_path / "bare")
    done = subprocess.run(["bash", str(REPO / "scripts" / "main.sh"), "--plan"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300,
                          env=_env(bare.parent, MODEL_PATH=str(model), USER_SIM_URLS="http://127.0.0.1:1",
                                   OUTPUT_DIR=str(tmp_path / "outputs")))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.startswith(f"python: {REPO}/.venv/bin/python (the checkout's .venv")
    h, f, head = 128, 256, 128 // 4  # Qwen2 by hand: tied embedding, q/k/v with biases, one key-value head
    layer = (h * h + h) + 2 * (h * head + head) + h * h + 3 * h * f + 2 * h
    count = 2048 * h + 2 * layer + h
    assert f"model: {count / 1e6:.2f}M parameters" in done.stdout and "0.00B" not in done.stdout


def test_a_missing_model_path_is_not_called_downloadable(tmp_path):
    done = subprocess.run(["bash", str(REPO / "scripts" / "main.sh"), "--dry-run"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120,
                          env=_env(None, MODEL_PATH="/models/nowhere", USER_SIM_URLS="http://127.0.0.1:1",
                                   OUTPUT_DIR=str(tmp_path / "outputs")))
    assert done.returncode == 0, done.stderr
    assert "MODEL_PATH=/models/nowhere is not a directory on this machine: nothing is downloaded" in done.stderr
    assert "download" not in done.stderr.replace("nothing is downloaded", "")


def test_a_steps_the_checkpoints_already_reach_is_called_out(tmp_path):
    from utils.cpu_recipe import RECIPE

    last = RECIPE.steps  # the CPU preset's step count
    outputs = tmp_path / "outputs"
    (outputs / "checkpoints" / "cpu_demo_outbound_ad_trial" / f"global_step_{last}").mkdir(parents=True)
    (outputs / "checkpoints" / "cpu_demo_outbound_ad_trial" / "global_step_2").mkdir()

    def dry_run(*args: str, **settings: str) -> str:
        done = subprocess.run(["bash", str(REPO / "scripts" / "main.sh"), "--dry-run", *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120,
                              env=_env(None, USER_SIM_URLS="http://127.0.0.1:1", OUTPUT_DIR=str(outputs), **settings))
        assert done.returncode == 0, done.stderr
        return done.stderr

    warned = dry_run("trainer.total_training_steps=2")
    assert ("WARNING: nothing to train: " in warned and f"already holds step {last} and trainer.total_training_steps=2 "
            "is the total number of steps, not the steps to add" in warned
            and f"trainer.total_training_steps={last + 2} trains 2 more" in warned)
    assert "nothing to train" in dry_run()  # the CPU preset's steps
    assert "nothing to train" not in dry_run(f"trainer.total_training_steps={last + 2}")
    assert "nothing to train" not in dry_run("trainer.resume_mode=disable", "trainer.total_training_steps=2")
