"""Repository layout rules that code review keeps forgetting: no `sys.path` edits outside the tests' conftest
files, the default scenario file named in one module only, the shared test helpers under tests/helpers/ (and
nothing outside tests/ importing them), no source file over 450 lines."""
from __future__ import annotations

import ast
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


def test_the_evaluation_commands_import_only_installed_packages():
    """`python for_evaluation/<name>.py` puts for_evaluation/ (not the repository) on sys.path, so a command may
    import only installed packages: the standard library, dependencies, `verl` and `llm_agent`."""
    local = {"for_evaluation", "utils", "bench", "tests", "scripts"} | {
        p.stem for p in (REPO / "for_evaluation").glob("*.py")}
    for path in sorted((REPO / "for_evaluation").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            assert not [n for n in names if n.split(".")[0] in local], (path.name, names)
            assert not (isinstance(node, ast.ImportFrom) and node.level), (path.name, "relative import")


@pytest.mark.processes
def test_an_evaluation_command_runs_as_a_script_from_anywhere_and_as_a_module(tmp_path):
    runs = {"script": subprocess.Popen([sys.executable, str(REPO / "for_evaluation" / "metrics_vis.py"), "--help"],
                                       cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
            "module": subprocess.Popen([sys.executable, "-m", "for_evaluation.report", "--help"], cwd=REPO,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)}
    for how, proc in runs.items():  # scripts/main.sh runs the report as a module
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0 and "usage:" in out, (how, err[-2000:])


def test_no_source_file_is_over_450_lines():
    # small files with one job: split a module by concept before it grows past this (tests are not source files)
    long = {str(p.relative_to(REPO)): n for p in _files(".py") if p.relative_to(REPO).parts[0] != "tests"
            and (n := len(p.read_text(encoding="utf-8").splitlines())) > 450}
    assert long == {}


def test_library_and_benchmarks_never_import_the_tests():
    # what a benchmark or a library module needs lives in a library module (or bench/), not in tests/helpers
    offenders = []
    for path in _files(".py"):
        if path.relative_to(REPO).parts[0] == "tests":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            offenders += [(str(path.relative_to(REPO)), n) for n in names if n.split(".")[0] == "tests"]
    assert offenders == []
