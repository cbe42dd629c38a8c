"""Say when a run could not learn: no training step had a non-zero advantage (its tracked `metrics.jsonl`).

GRPO-style advantages are 0 for every sample of a prompt group whose rewards are all equal: when every dialogue
of a step ends the same way (e.g. every call times out because `max_turns` is too small to finish one), the
policy gradient is 0 and only the KL term moves the policy. scripts/main.sh prints this after a run:

    python -m utils.learning_signal outputs/logs/<experiment>/metrics.jsonl
    -> WARNING: this run could not learn: none of its 2 training steps had a non-zero advantage ...

Nothing is printed when some step had a signal and none lacked it; a note counts the steps without one.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

NONZERO_KEY = "critic/advantages/nonzero_frac"
# The dialogue outcome rates (llm_agent/metrics.py) and what to change when every training dialogue ends so.
OUTCOME_ADVICE = {
    "dialogue/timeout_rate": ("timed out (rollout_loop.config.max_turns reached)",
                              "raise rollout_loop.config.max_turns so that a call can end"),
    "dialogue/truncated_rate": ("ran out of its token budget (data.max_response_length)",
                                "raise data.max_response_length"),
    "dialogue/hang_up_rate": ("ended with the user hanging up", "start from a model that completes calls sometimes"),
    "dialogue/agent_ended_rate": ("ended with the agent giving up", "start from a model that completes calls "
                                  "sometimes"),
    "dialogue/completion_rate": ("completed", "make the task harder (the state controller's target rate)"),
    "dialogue/error_rate": ("ended in a simulator error", "check the simulators (user_sim/* metrics, their logs)"),
}


def training_steps(path: str | Path) -> list[Mapping[str, Any]]:
    """The tracked lines of `path` that describe a training step (they carry advantage statistics); a torn or
    non-JSON line is skipped."""
    steps = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(item, dict) and (NONZERO_KEY in item or "critic/advantages/max" in item):
                steps.append(item)
    return steps


def has_signal(step: Mapping[str, Any]) -> bool:
    """Whether some loss token of the step had a non-zero advantage (logs without the fraction: max or min != 0)."""
    if NONZERO_KEY in step:
        return float(step[NONZERO_KEY]) > 0
    return float(step.get("critic/advantages/max", 0.0)) != 0 or float(step.get("critic/advantages/min", 0.0)) != 0


def same_outcome(steps: Sequence[Mapping[str, Any]]) -> str | None:
    """The outcome-rate key that is 1 in every step (every training dialogue ended that way), if any."""
    for key in OUTCOME_ADVICE:
        if steps and all(step.get(key) == 1.0 for step in steps):
            return key
    return None


def signal_report(steps: Sequence[Mapping[str, Any]]) -> str | None:
    """A warning when no step had a learning signal, a note when some lacked one, None when all had one."""
    if not steps:
        return None
    without = [step for step in steps if not has_signal(step)]
    if not without:
        return None
    if len(without) < len(steps):
        return (f"note: {len(without)} of {len(steps)} training steps had no learning signal (every advantage 0: "
                "the samples of each prompt group got equal rewards)")
    text = (f"WARNING: this run could not learn: none of its {len(steps)} training steps had a non-zero advantage "
            "(the samples of each prompt group got equal rewards, so the policy gradient was 0)")
    outcome = same_outcome(steps)
    if outcome is not None:
        what, advice = OUTCOME_ADVICE[outcome]
        text += f"; every training dialogue {what}: {advice}"
    elif all(step.get("dialogue/completion_rate") == 0.0 for step in steps):
        text += ("; no training dialogue completed (each hung up, gave up or timed out): start from a model that "
                 "completes calls sometimes, or allow longer calls (rollout_loop.config.max_turns)")
    return text


def main(argv: list[str] | None = None) -> int:
    """Print the report of a run's metrics file (nothing when every step had a signal); 1 when unreadable."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", help="the run's tracked metrics (trainer.log_dir/metrics.jsonl)")
    args = parser.parse_args(argv)
    try:
        report = signal_report(training_steps(args.metrics))
    except OSError as exc:
        print(f"learning_signal: cannot read {args.metrics}: {exc.strerror}", file=sys.stderr)
        return 1
    if report:
        print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
