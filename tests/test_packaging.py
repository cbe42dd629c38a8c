"""Packaging: the declared Python version matches what the code needs, install_requires holds ranges (exact pins
live in constraints.txt, so the package installs beside an existing CUDA torch), and every declared dependency is
imported somewhere in the project."""
from __future__ import annotations

import re
from pathlib import Path

from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
# distribution name -> the import name(s) that use it
IMPORT_NAMES = {"pyyaml": ["yaml"], "hydra-core": ["hydra"], "tensorboard": ["torch.utils.tensorboard"]}


def _requirements() -> list[str]:
    lines = (REPO / "requirements.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def _sources() -> str:
    files = [p for d in ("verl", "llm_agent", "utils", "bench", "for_evaluation", "scripts")
             for p in (REPO / d).rglob("*.py")]
    return "\n".join(p.read_text(encoding="utf-8") for p in files)


def test_python_requires_matches_the_code():
    setup = (REPO / "setup.py").read_text()
    assert 'python_requires=">=3.11"' in setup
    assert "asyncio.timeout(" in (REPO / "llm_agent/user_sim/client/http_client.py").read_text()  # new in 3.11


def test_install_requires_has_no_exact_pins_and_constraints_pin_torch():
    assert not [r for r in _requirements() if "==" in r]
    assert "torch==2.13.0" in (REPO / "constraints.txt").read_text()


def test_every_declared_dependency_is_imported():
    sources = _sources()
    unused = []
    for requirement in _requirements():
        name = re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower()
        modules = IMPORT_NAMES.get(name, [name.replace("-", "_")])
        if not any(re.search(rf"^\s*(import|from)\s+{re.escape(m)}\b", sources, re.M) for m in modules):
            unused.append(name)
    assert unused == []


def _lower_bound(requirement: str) -> Version:
    return Version(re.search(r">=([0-9][0-9.]*)", requirement).group(1))


def test_the_lowest_versions_ci_installs_are_the_declared_lower_bounds():
    """constraints_lowest.txt (installed into .venv-vllm) pins each package it names at requirements.txt's lower
    bound, and the vLLM requirements start from the same transformers."""
    declared = {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower(): r for r in _requirements()}
    lines = (REPO / "constraints_lowest.txt").read_text().splitlines()
    pins = dict(line.split("==") for line in lines if line.strip() and not line.startswith("#"))
    assert "transformers" in pins
    for name, version in pins.items():
        assert _lower_bound(declared[name]) == Version(version), name
    vllm_transformers = next(line for line in (REPO / "requirements_vllm.txt").read_text().splitlines()
                             if line.startswith("transformers"))
    assert _lower_bound(vllm_transformers) == Version(pins["transformers"])
    assert _lower_bound(declared["torch"]) == Version("2.11")  # the oldest torch whose signatures the tests hold
