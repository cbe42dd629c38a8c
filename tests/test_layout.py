"""Repository layout rules that code review keeps forgetting: no `sys.path` edits outside the tests' conftest
files, the default scenario file named in one module only, and the shared test helpers under tests/helpers/."""
from __future__ import annotations

import re
from pathlib import Path

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
