"""Plot how training went: training and validation curves, the controller's weights, CR by initial state, cache.

    python for_evaluation/metrics_vis.py                          # the latest run under outputs/ (after make demo)
    python for_evaluation/metrics_vis.py --run outputs/logs/a --run outputs/logs/b --out outputs/plots/a_vs_b
    python for_evaluation/metrics_vis.py --run outputs/logs/cpu_demo_outbound_ad_trial --smooth 0   # raw curves only

A run is a main.sh output root (its latest experiment), a log directory `outputs/logs/<experiment>`, its
`metrics.jsonl`, a rollout log or an evaluation's `<name>_dialogues.jsonl`. Several --run are drawn on the same
axes, one colour per run. Writes PNG and SVG files (default `<root>/plots/<experiment>/`) and prints their paths;
figures without data are skipped with a note on stderr.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from llm_agent.evaluation.defaults import DEFAULT_OUTPUTS, DEFAULT_SMOOTH


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--run", action="append", default=[], metavar="DIR",
                   help="a run to plot (repeat to compare runs); default: the latest run under --outputs")
    p.add_argument("--outputs", default=DEFAULT_OUTPUTS, help="main.sh output root searched when no --run is given")
    p.add_argument("--out", default=None, help="directory for the figures (default <root>/plots/<experiment>)")
    p.add_argument("--smooth", type=float, default=DEFAULT_SMOOTH,
                   help="EMA weight in [0, 1) for training curves; raw points are drawn faintly (0: raw only)")
    p.add_argument("--format", action="append", choices=("png", "svg", "pdf"), default=None,
                   help="file format(s) (default png and svg)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Plot the runs and print one written path per line."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    # imported here, after parsing, so that --help answers without loading numpy and matplotlib
    from llm_agent.evaluation.plots import load_run, plot_runs
    from llm_agent.evaluation.run_data import default_plot_dir, find_latest_run, resolve_run

    if not 0.0 <= args.smooth < 1.0:
        raise SystemExit(f"--smooth must be in [0, 1), got {args.smooth}")
    try:
        files = [resolve_run(r) for r in args.run] if args.run else [find_latest_run(args.outputs)]
    except FileNotFoundError as exc:
        raise SystemExit(str(exc)) from None
    out = Path(args.out) if args.out else default_plot_dir(files)
    runs = []
    for f in files:
        print(f"run {f.name}: {f.describe()}", file=sys.stderr)
        runs.append(load_run(f))
    result = plot_runs(runs, out, smooth=args.smooth, formats=tuple(args.format or ("png", "svg")))
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    for path in result.files:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
