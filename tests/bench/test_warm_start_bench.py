"""bench/warm_start.py: the recipe's warm start with and without keeping the gathered weights, side by side."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.repo import REPO


@pytest.mark.slow  # two torchrun launches of a 3-step warm start: 21-29 s
@pytest.mark.extended  # make test-extended (CI), kept out of make test's 20 minutes
def test_the_benchmark_times_both_set_ups_and_finds_the_same_weights(tmp_path):
    out = tmp_path / "warm_start.json"
    done = subprocess.run([sys.executable, "-m", "bench.warm_start", "--steps", "3", "--repeats", "1", "--dialogues",
                           "16", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["setup"]: r for r in result["rows"]}
    assert set(rows) == {"reshard after forward", "keep gathered weights"}
    assert all(r["same_losses"] and r["same_weights"] and len(r["runs"]) == 1 for r in rows.values())
    assert result["speedup"] == pytest.approx(rows["reshard after forward"]["median_s"]
                                              / rows["keep gathered weights"]["median_s"], abs=1e-3)
    assert "speed-up of keeping the gathered weights" in done.stdout and result["machine"]["cores"] >= 1
