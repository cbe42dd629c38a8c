"""Learning: the CPU demo (`make demo`, i.e. scripts/main.sh on the CPU preset with the CPU learning recipe of
utils/cpu_recipe.py) raises the greedy validation completion rate (CR) of its warm-started model: the real trainer
(Ray, 2 FSDP workers), the SEAD rollout loop with the state controller and the cache, two scripted simulator
servers, all seeded by launch.seed. BENCHMARKS.md ("Learning") has this run per seed and CPU float path.

Statistics. Validation calls each of the fixed test profiles once with greedy decoding against seeded
simulators, before training and after it, so the calls pair up by profile. The test counts the profiles that
failed before and completed after (gained) and the reverse (lost) from the rollout log's per-dialogue outcomes,
and asserts a one-sided exact sign (McNemar) test p < ALPHA: if training did not make completion more likely
(a gained profile no likelier than a lost one), the test passes with probability at most ALPHA. The run's own
record (val_metrics.jsonl) and the demo's last line must agree with the CRs recounted from the rollout log.
Check another seed with SEAD_LEARNING_SEED=1, 2, ...; another CPU's float path with ATEN_CPU_CAPABILITY.
"""
from __future__ import annotations

import json
import math
import os
import subprocess

import pytest

from bench.learning import read_jsonl
from tests.helpers.repo import REPO
from utils.cpu_recipe import RECIPE

SEED = int(os.environ.get("SEAD_LEARNING_SEED", "0"))
EXPERIMENT = "cpu_demo_outbound_ad_trial"
ALPHA = 0.05


def _val_outcomes(rollouts: list[dict], step: int) -> dict[tuple, bool]:
    """Whether each validation call of `step` completed, keyed by its batch position and profile."""
    out = {}
    for r in rollouts:
        if r["split"] == "val" and r["step"] == step:
            out[(r["uid"].split("_", 1)[1], json.dumps(r["profile"], sort_keys=True))] = r["outcome"] == "completed"
    return out


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.learning
@pytest.mark.timeout(1800)  # a warm start and the recipe's steps: ~5-6 minutes quiet, more under load (BENCHMARKS.md)
def test_the_demo_raises_the_greedy_validation_completion_rate_of_its_warm_started_model(tmp_path):
    out = tmp_path / "outputs"
    env = {**os.environ, "OUTPUT_DIR": str(out)}
    proc = subprocess.run(["bash", "scripts/main.sh", f"launch.seed={SEED}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    rollouts = read_jsonl(out / "rollouts" / EXPERIMENT / "rollouts.jsonl")
    before, after = _val_outcomes(rollouts, 0), _val_outcomes(rollouts, RECIPE.steps)
    assert len(before) == RECIPE.test_samples and set(after) == set(before)
    n = len(before)
    cr_before, cr_after = sum(before.values()) / n, sum(after.values()) / n
    recorded = {v["step"]: v["metrics"]["completion_rate"]
                for v in read_jsonl(out / "evaluation" / EXPERIMENT / "val_metrics.jsonl")}
    assert recorded == {0: pytest.approx(cr_before), RECIPE.steps: pytest.approx(cr_after)}
    assert (f"validation completion rate: before {cr_before:.3f} (step 0) -> after {cr_after:.3f} "
            f"(step {RECIPE.steps})") in proc.stdout
    gained = sum(after[k] and not before[k] for k in before)
    lost = sum(before[k] and not after[k] for k in before)
    p = sum(math.comb(gained + lost, k) for k in range(gained, gained + lost + 1)) / 2 ** (gained + lost)
    summary = {"seed": SEED, "capability": os.environ.get("ATEN_CPU_CAPABILITY", "native"),
               "completed_before": sum(before.values()), "completed_after": sum(after.values()),
               "gained": gained, "lost": lost, "n": n, "p": p}
    print(f"learning run: {json.dumps(summary)}")
    assert p < ALPHA, summary
