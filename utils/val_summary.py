"""Print the validation completion rate before and after training from a run's validation metrics file.

The rollout loop appends one JSON line per validation to `rollout_loop.config.val_metrics_path`:
`{"step": N, "n_dialogues": K, "metrics": {"completion_rate": ..., ...}}`. Within one run the steps increase,
so a line whose step is not above the previous line's starts a new run (a rerun appends to the same file); the
summary is about the last run: its first validation (step 0 with `trainer.val_before_train=true`) and its last.

    python -m utils.val_summary outputs/evaluation/<experiment>/val_metrics.jsonl
    -> validation completion rate: before 0.062 (step 0) -> after 0.312 (step 8) (16 dialogues)
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Validation:
    """One validation line: the training step, how many dialogues it ran and their completion rate (None when it
    is undefined: every dialogue ended in a simulator error, so the metrics left it out)."""

    step: int
    n_dialogues: int
    completion_rate: float | None

    def cr_text(self) -> str:
        """The completion rate with 3 decimals, or n/a."""
        return "n/a (every dialogue failed)" if self.completion_rate is None else f"{self.completion_rate:.3f}"


def read_validations(path: str | Path) -> list[Validation]:
    """Every validation line of `path`, in file order; ValueError names the file and line of a bad one."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
            metrics = item.get("metrics") if isinstance(item, dict) else None
            if not isinstance(metrics, dict):
                raise ValueError(f"{where}: expected an object with 'step', 'n_dialogues' and 'metrics'")
            step, n, cr = item.get("step"), item.get("n_dialogues"), metrics.get("completion_rate")
            if isinstance(step, bool) or not isinstance(step, int):
                raise ValueError(f"{where}: 'step' must be an integer, got {step!r}")
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"{where}: 'n_dialogues' must be an integer >= 0, got {n!r}")
            if "completion_rate" not in metrics and (n == 0 or metrics.get("error_rate") == 1.0):
                out.append(Validation(step, n, None))  # undefined: no dialogue ended without a simulator error
                continue
            if isinstance(cr, bool) or not isinstance(cr, (int, float)) or not 0.0 <= cr <= 1.0:
                raise ValueError(f"{where}: 'metrics.completion_rate' must be a number in [0, 1], got {cr!r}")
            out.append(Validation(step, n, float(cr)))
    return out


def last_run(validations: list[Validation]) -> list[Validation]:
    """The validations of the last run: from the last line whose step is not above its predecessor's."""
    start = 0
    for i in range(1, len(validations)):
        if validations[i].step <= validations[i - 1].step:
            start = i
    return validations[start:]


def summary_line(validations: list[Validation]) -> str:
    """`validation completion rate: before X (step a) -> after Y (step b) (N dialogues)` for the last run."""
    if not validations:
        raise ValueError("no validation lines")
    run = last_run(validations)
    first, last = run[0], run[-1]
    n = f"{last.n_dialogues} dialogues" if first.n_dialogues == last.n_dialogues else \
        f"{first.n_dialogues} and {last.n_dialogues} dialogues"
    if len(run) == 1:
        return f"validation completion rate: {last.cr_text()} (step {last.step}, the run's only validation) ({n})"
    return (f"validation completion rate: before {first.cr_text()} (step {first.step}) -> after "
            f"{last.cr_text()} (step {last.step}) ({n})")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; exit status 1 with a message naming the file when it cannot be summarised."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("val_metrics", help="JSONL file of validation metrics (rollout_loop.config.val_metrics_path)")
    args = parser.parse_args(argv)
    try:
        line = summary_line(read_validations(args.val_metrics))
    except OSError as exc:
        print(f"val_summary: cannot read {args.val_metrics}: {exc.strerror}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"val_summary: {args.val_metrics}: {exc}", file=sys.stderr)
        return 1
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
