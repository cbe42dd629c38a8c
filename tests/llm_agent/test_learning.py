"""Learning: GRPO with the completion-only reward raises the greedy validation completion rate (CR) of a
warm-started small model, on the real trainer (Ray, 2 FSDP workers), the SEAD rollout loop with the state
controller, and two scripted simulator servers (seeded; a smaller bench/learning.py run, see that module).

The warm start is supervised fine-tuning on a mixture of scripted calls: "evasive" ones (the agent answers only
a third of the doubt categories, so most of its calls end in a hang-up) and "good" ones (every doubt answered,
the call completes). Greedy, the warm policy mostly takes the evasive mode; sampled, it sometimes answers an
unfamiliar doubt and completes, and those calls are the only ones with reward (completion only).

Statistics. Validation is greedy on N fixed test profiles against a seeded simulator, so the CR before and
after training are computed on the same N simulated users and each user's call is deterministic given the
policy. Pair them: b users go from not completed to completed, c the other way. If training had not made
the policy better at completing (only changed it), a user whose outcome changed would be as likely to flip
either way (McNemar's null), so b ~ Binomial(b + c, 1/2). The test asserts the gain (b - c) / N >= MIN_GAIN
and the exact one-sided McNemar p-value P(X >= b | b + c) < 0.01, so a chance fluctuation of an unchanged
policy's quality is excluded at the 1 % level. The run's own record (val_metrics.jsonl) must agree with the
CRs recounted from the rollout log's per-dialogue outcomes. Check robustness with SEAD_LEARNING_SEED=1, 2, ...
"""
from __future__ import annotations

import json
import math
import os

import pytest

from bench.learning import LearningSettings, read_jsonl, run_grpo, warm_start

SEED = int(os.environ.get("SEAD_LEARNING_SEED", "0"))
SETTINGS = LearningSettings(seed=SEED, sft_dialogues=64, sft_steps=150, steps=8, prompts_per_step=4,
                            group_size=8, test_samples=32, test_freq=8)
MIN_GAIN = 0.15


def mcnemar_one_sided(b: int, c: int) -> float:
    """P(X >= b) for X ~ Binomial(b + c, 1/2): the exact one-sided McNemar p-value of b improvements, c losses."""
    n = b + c
    return sum(math.comb(n, k) for k in range(b, n + 1)) / 2 ** n if n else 1.0


def test_mcnemar_one_sided_matches_hand_computed_values():
    assert mcnemar_one_sided(0, 0) == 1.0
    assert mcnemar_one_sided(3, 0) == pytest.approx(1 / 8)
    assert mcnemar_one_sided(2, 1) == pytest.approx(4 / 8)
    assert mcnemar_one_sided(7, 0) == pytest.approx(1 / 128)


def _val_outcomes(rollouts: list[dict], step: int) -> list[tuple[str, bool]]:
    """(profile JSON, completed) of each validation dialogue at `step`, in validation order."""
    return [(json.dumps(r["profile"], sort_keys=True), r["outcome"] == "completed") for r in rollouts
            if r["split"] == "val" and r["step"] == step]


@pytest.mark.slow
def test_grpo_raises_the_greedy_completion_rate_of_a_warm_started_model(tmp_path, ray_cluster):
    warm, sft_s = warm_start(SETTINGS, tmp_path)
    grpo_s = run_grpo(SETTINGS, warm, tmp_path)

    rollouts = read_jsonl(tmp_path / "rollouts.jsonl")
    before, after = _val_outcomes(rollouts, 0), _val_outcomes(rollouts, SETTINGS.steps)
    assert len(before) == len(after) == SETTINGS.test_samples
    assert [p for p, _ in before] == [p for p, _ in after], "the same fixed profiles, in the same order"
    b = sum(not x and y for (_, x), (_, y) in zip(before, after))
    c = sum(x and not y for (_, x), (_, y) in zip(before, after))
    n = SETTINGS.test_samples
    cr_before, cr_after = sum(x for _, x in before) / n, sum(y for _, y in after) / n
    recorded = {v["step"]: v["metrics"]["completion_rate"] for v in read_jsonl(tmp_path / "val_metrics.jsonl")}
    assert recorded == {0: pytest.approx(cr_before), SETTINGS.steps: pytest.approx(cr_after)}
    summary = {"seed": SEED, "sft_s": round(sft_s), "grpo_s": round(grpo_s), "cr_before": cr_before,
               "cr_after": cr_after, "improved": b, "worsened": c, "p": mcnemar_one_sided(b, c)}
    print(f"learning run: {json.dumps(summary)}")
    assert (b - c) / n >= MIN_GAIN and mcnemar_one_sided(b, c) < 0.01, summary
