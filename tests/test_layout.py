"""Repository layout rules that code review keeps forgetting: no `sys.path` edits outside the tests' conftest
files, the default scenario file named in one module only, and the shared test helpers under tests/helpers/."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from llm_agent.scenario import DEFAULT_SCENARIO_NAME, DEFAULT_SCENARIO_PATH, SCENARIO_DIR

REPO = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("verl", "llm_agent", "utils", "bench", "for_evaluation", "scripts", "tests")


def _files(*suffixes: str) -> list[Path]:
    return [p for d in SOURCE_DIRS for p in (REPO / d).rglob("*") if p.suffix in suffixes and p.is_file()]


def test_no_sys_path_edits_outside_the_tests_conftest():
    pattern = re.compile(r"sys\.path\.(insert|append)|sys\.path\s*\+?=")
    offenders = [str(p.relative_to(REPO)) for p in _files(".py")
                 if p.name != "conftest.py" and pattern.search(p.read_text(encoding="utf-8"))]
    assert offenders == []


def test_the_default_scenario_file_is_named_in_one_module():
    # the trainer's YAML config names it as a value users edit; code and scripts read llm_agent.scenario.paths
    needle = f"format_prompt/{DEFAULT_SCENARIO_NAME}.yaml"
    naming = sorted(str(p.relative_to(REPO)) for p in _files(".py", ".sh") if needle in p.read_text(encoding="utf-8"))
    assert naming == []
    assert DEFAULT_SCENARIO_PATH.is_file() and DEFAULT_SCENARIO_PATH.parent == SCENARIO_DIR


def test_test_helpers_live_in_tests_helpers():
    # every non-test module under tests/ other than conftest files is a helper, and helpers sit in one package
    stray = [str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("*.py")
             if not p.name.startswith("test_") and p.name != "conftest.py" and p.parent.name != "helpers"]
    assert stray == []


@pytest.mark.processes
def test_the_evaluation_commands_run_as_scripts_from_anywhere_and_as_modules(tmp_path):
    commands = sorted(p.stem for p in (REPO / "for_evaluation").glob("*.py") if p.stem != "__init__")
    assert {"evaluate", "metrics_table", "metrics_vis", "report", "analyze_mistakes"} <= set(commands)
    runs = {}
    for name in commands:  # all at once: each is mostly an interpreter start and imports
        runs[f"{name}.py"] = subprocess.Popen([sys.executable, str(REPO / "for_evaluation" / f"{name}.py"), "--help"],
                                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for name in ("report", "metrics_vis"):  # scripts/main.sh runs the report as a module
        runs[f"-m {name}"] = subprocess.Popen([sys.executable, "-m", f"for_evaluation.{name}", "--help"], cwd=REPO,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for how, proc in runs.items():
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0 and "usage:" in out, (how, err[-2000:])
