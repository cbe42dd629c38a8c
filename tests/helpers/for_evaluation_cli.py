"""Test helper: call the for_evaluation/ commands' functions in-process (`for_evaluation` is a package)."""
from __future__ import annotations

import importlib
from types import ModuleType


def load_script(name: str) -> ModuleType:
    """The module of the command `python -m for_evaluation.<name>`."""
    return importlib.import_module(f"for_evaluation.{name}")


def run_table(argv: list[str]) -> str:
    """metrics_table's run() on `argv`: the text it printed."""
    module = load_script("metrics_table")
    return module.run(module.parse_args(argv))
