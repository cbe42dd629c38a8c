"""The evaluation commands answer --help without importing their heavy dependencies (it took 8-15 s when
numpy, matplotlib and torch were imported at the top of the command modules)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.repo import REPO

COMMANDS = ("evaluate", "metrics_table", "metrics_vis", "report", "analyze_mistakes", "chat")
HEAVY = ("numpy", "matplotlib", "torch", "transformers", "pandas", "pyarrow", "httpx", "yaml")

# one fresh interpreter (the test session has numpy loaded): every command's --help, then what got imported
PROBE = f"""
import contextlib, io, json, sys, importlib
usages = {{}}
for name in {COMMANDS!r}:
    module = importlib.import_module("for_evaluation." + name)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        module.parse_args(["--help"])
    usages[name] = out.getvalue().startswith("usage:")
print(json.dumps({{"usages": usages, "heavy": sorted(m for m in {HEAVY!r} if m in sys.modules)}}))
"""


@pytest.mark.processes
def test_help_loads_no_heavy_dependency():
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["usages"] == {name: True for name in COMMANDS}
    assert found["heavy"] == []
