"""The paper table: CR, FPR, SCR, ATT, ADT, UPA, EI, TI, CI of evaluated agents side by side with bootstrap 95%
intervals and their cost per 1,000 dialogues, and a paired test of the CR difference between agents.

    python for_evaluation/metrics_table.py outputs/eval/*_results.json
    python for_evaluation/metrics_table.py a_results.json b_dialogues.jsonl --format markdown
    python for_evaluation/metrics_table.py outputs/rollouts/cpu_demo_outbound_ad_trial/rollouts.jsonl --split val --scenario S.yaml
    python for_evaluation/metrics_table.py outputs/eval/*_results.json --out-dir paper/   # all four formats

Inputs: `<name>_results.json` files of for_evaluation/evaluate.py, their `<name>_dialogues.jsonl`, or a training
run's `rollouts.jsonl` (default split: eval if present, else val; default step: the last). Metrics are recomputed
from the dialogues with llm_agent/metrics.py; an undefined one (ATT when no call completed) prints as n/a. CI is the
cooperation improvement; brackets are percentile bootstrap intervals. Cost: agent tokens, simulator requests and
wall seconds per 1,000 dialogues. Pairs are compared with a paired bootstrap interval of the CR difference and
McNemar's exact test. `--format latex` is a complete tabular environment.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from llm_agent.evaluation.defaults import DEFAULT_CONFIDENCE, DEFAULT_RESAMPLES, TABLE_FORMATS

SUFFIX = {"terminal": "txt", "markdown": "md", "csv": "csv", "latex": "tex"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("inputs", nargs="+", metavar="RESULTS_OR_DIALOGUES")
    p.add_argument("--name", action="append", default=None, help="display name per input, in order (repeatable)")
    p.add_argument("--scenario", default=None, help="scenario YAML for dialogue logs (results files name theirs)")
    p.add_argument("--split", default=None, help="split of a dialogue log (default: eval, else val)")
    p.add_argument("--step", type=int, default=None, help="step of a dialogue log (default: its last)")
    p.add_argument("--format", choices=TABLE_FORMATS, default="terminal", help="what to print")
    p.add_argument("--out-dir", default=None, help="also write table.{txt,md,csv,tex} there")
    p.add_argument("--digits", type=int, default=3)
    p.add_argument("--n-resamples", type=int, default=DEFAULT_RESAMPLES, help="bootstrap resamples per interval")
    p.add_argument("--confidence", type=float, default=DEFAULT_CONFIDENCE)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> str:
    """Build the table; print it in --format and write every format under --out-dir. Returns the printed text."""
    from llm_agent.evaluation.table import FORMATS, build_table, load_evaluation, render  # numpy: after --help

    names = args.name or []
    if names and len(names) != len(args.inputs):
        raise ValueError(f"--name given {len(names)} times for {len(args.inputs)} inputs")
    evals = [load_evaluation(path, args.scenario, args.split, args.step, names[i] if names else None)
             for i, path in enumerate(args.inputs)]
    table = build_table(evals, args.n_resamples, args.confidence, args.seed)
    if args.out_dir:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for fmt in FORMATS:
            path = out / f"table.{SUFFIX[fmt]}"
            path.write_text(render(table, fmt, args.digits))
            logging.getLogger(__name__).info("wrote %s", path)
    text = render(table, args.format, args.digits)
    print(text, end="")
    return text


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point; bad input exits with a one-line error."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    try:
        run(parse_args(argv))
    except (ValueError, OSError) as exc:
        raise SystemExit(f"metrics_table: {exc}") from None


if __name__ == "__main__":
    main()
