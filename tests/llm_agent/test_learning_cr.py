"""Learning: GRPO with the completion-only reward raises the validation completion rate (CR) of a warm-started
small model, on the real trainer (Ray, 2 FSDP workers), the SEAD rollout loop with the state controller, and two
scripted simulator servers (seeded; a shorter bench/learning.py run, see that module for the recipe).

The warm start is supervised fine-tuning on a mixture of scripted calls: "evasive" ones (the agent answers only
a third of the doubt categories, so most of its calls end in a hang-up) and "good" ones (every doubt answered,
the call completes). The warm policy is a mixture too: it rarely completes, but its samples sometimes answer an
unfamiliar doubt and complete, and those calls are the only ones with reward (completion only).

Statistics. Validation samples VAL_N calls (temperature 0.7) for each of the 32 fixed test profiles against a
seeded simulator, N = 128 dialogues before training and N after. Under the null "training did not change the
policy's completion probability", the completed calls of the two validations are draws from one rate, and
given their total K the number after training is hypergeometric (Fisher's exact test; calls of one profile
share the user, which makes the real variance a little larger, so the test also demands a gain of MIN_GAIN).
The test asserts CR_after - CR_before >= MIN_GAIN and the one-sided Fisher p-value < 0.01. The run's own
record (val_metrics.jsonl) must agree with the CRs recounted from the rollout log's per-dialogue outcomes.
Check robustness with SEAD_LEARNING_SEED=1, 2, ...

Status: opt-in (SEAD_LEARNING_CR=1), not part of CI. Its one full run on the shared developers' box (seed 0,
about 12 minutes under heavy load: SFT 285 s, GRPO 400 s) FAILED: 17 of 128 validation calls completed before
and 13 after 8 GRPO steps. The longer bench run (16 steps, greedy validation) reached +12.5 points; see
BENCHMARKS.md. A recipe that gives a significant gain within a CI budget is still to be found.
"""
from __future__ import annotations

import json
import math
import os

import pytest

from bench.learning import LearningSettings, read_jsonl, run_grpo, warm_start

SEED = int(os.environ.get("SEAD_LEARNING_SEED", "0"))
VAL_N = 4
SETTINGS = LearningSettings(seed=SEED, steps=8, test_freq=8, test_samples=32, val_temperature=0.7, val_n=VAL_N)
MIN_GAIN = 0.10


def fisher_one_sided(before: int, n_before: int, after: int, n_after: int) -> float:
    """P(X >= after) for X hypergeometric: `after` of the before + after completions falling in the second
    sample of n_after (one-sided Fisher exact test for a higher rate after)."""
    total = before + after
    denominator = math.comb(n_before + n_after, total)
    return sum(math.comb(n_after, k) * math.comb(n_before, total - k)
               for k in range(after, min(total, n_after) + 1)) / denominator


def test_fisher_one_sided_matches_hand_computed_values():
    assert fisher_one_sided(0, 4, 0, 4) == 1.0
    assert fisher_one_sided(0, 2, 2, 2) == pytest.approx(1 / 6)  # both completions after: 1 of C(4,2) ways
    assert fisher_one_sided(1, 2, 1, 2) == pytest.approx(5 / 6)
    assert fisher_one_sided(0, 5, 3, 5) == pytest.approx(1 / 12)  # C(5,3) / C(10,3)


def _val_completions(rollouts: list[dict], step: int) -> tuple[int, int]:
    """(completed, dialogues) of the validation at `step`, from the rollout log."""
    lines = [r for r in rollouts if r["split"] == "val" and r["step"] == step]
    return sum(r["outcome"] == "completed" for r in lines), len(lines)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("SEAD_LEARNING_CR") != "1",
                    reason="opt-in (SEAD_LEARNING_CR=1): its only run did not reach the gain; see the docstring")
def test_grpo_raises_the_validation_completion_rate_of_a_warm_started_model(tmp_path, ray_cluster):
    warm, sft_s = warm_start(SETTINGS, tmp_path)
    grpo_s = run_grpo(SETTINGS, warm, tmp_path)

    rollouts = read_jsonl(tmp_path / "rollouts.jsonl")
    (before, n_before), (after, n_after) = _val_completions(rollouts, 0), _val_completions(rollouts, SETTINGS.steps)
    assert n_before == n_after == SETTINGS.test_samples * VAL_N
    recorded = {v["step"]: v["metrics"]["completion_rate"] for v in read_jsonl(tmp_path / "val_metrics.jsonl")}
    assert recorded == {0: pytest.approx(before / n_before), SETTINGS.steps: pytest.approx(after / n_after)}
    p = fisher_one_sided(before, n_before, after, n_after)
    summary = {"seed": SEED, "sft_s": round(sft_s), "grpo_s": round(grpo_s), "completed_before": before,
               "completed_after": after, "n": n_before, "p": p}
    print(f"learning run: {json.dumps(summary)}")
    assert (after - before) / n_before >= MIN_GAIN and p < 0.01, summary
