"""Test helper: call the for_evaluation/ scripts' main() in-process (they are scripts, not a package)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def load_script(name: str):
    """Import for_evaluation/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(f"for_evaluation_{name}", REPO / "for_evaluation" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_table(argv: list[str]) -> str:
    """metrics_table.py's run() on `argv`: the text it printed."""
    module = load_script("metrics_table")
    return module.run(module.parse_args(argv))
