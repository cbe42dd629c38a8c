"""Write the HTML report of a run or an evaluation: plots, metrics, mistakes analysis and a dialogue browser.

    python for_evaluation/report.py                                    # the latest run under outputs/
    python for_evaluation/report.py outputs/logs/cpu_demo_outbound_ad_trial --out /tmp/cpu_demo_outbound_ad_trial.html
    python for_evaluation/report.py outputs/eval/cpu_demo_outbound_ad_trial/rl_dialogues.jsonl
    python for_evaluation/report.py outputs/eval/cpu_demo_outbound_ad_trial/rl_dialogues.jsonl \\
        --human outputs/eval/human/human_dialogues.jsonl

Calls a person played (python -m for_evaluation.chat) show as their own group (split `eval@human`) beside the
simulated dialogues: a `human_dialogues.jsonl` beside the evaluation's dialogues file is read along, others with
--human.

The report is one self-contained file (nothing is loaded from the network; open it from disk). It prints its
path. Default location: `<root>/reports/<experiment>.html` for a run, `<dir>/<name>_report.html` beside an
evaluation's dialogues file.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

from llm_agent.evaluation.defaults import DEFAULT_BROWSER_LIMIT, DEFAULT_OUTPUTS, DEFAULT_RESAMPLES, DEFAULT_SMOOTH


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("run", nargs="?", default=None,
                   help="a run (output root, log dir, metrics.jsonl, rollouts.jsonl or *_dialogues.jsonl); "
                        "default: the latest run under --outputs")
    p.add_argument("--outputs", default=DEFAULT_OUTPUTS, help="main.sh output root searched when no run is given")
    p.add_argument("--out", default=None, help="the HTML file to write")
    p.add_argument("--dialogues", default=None,
                   help="the run's rollout log when it is not where main.sh puts it (<root>/rollouts/<experiment>)")
    p.add_argument("--human", action="append", default=[], metavar="FILE",
                   help="dialogues of calls a person played (for_evaluation/chat.py's human_dialogues.jsonl) to "
                        "show beside the run's (repeatable)")
    p.add_argument("--scenario", default=None,
                   help="the run's scenario YAML (stage names, state ranges; default: the demo's)")
    p.add_argument("--smooth", type=float, default=DEFAULT_SMOOTH, help="EMA weight of the training curves (0: raw)")
    p.add_argument("--bootstrap", type=int, default=DEFAULT_RESAMPLES,
                   help="bootstrap resamples for the metric intervals, as many as metrics_table.py's by default "
                        "(0: no intervals)")
    p.add_argument("--controller", action="append", default=[], metavar="KEY=VALUE",
                   help="ControllerConfig override for the recommended weights, e.g. target_completion_rate=0.6")
    p.add_argument("--browser-limit", type=int, default=DEFAULT_BROWSER_LIMIT,
                   help="the dialogue browser holds the last N dialogues (metrics and analysis use all)")
    p.add_argument("--simulator-card", action="append", default=[], metavar="FILE",
                   help="a simulator report card (python -m for_evaluation.simulator_report) to show (repeatable)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Write the report and print its path."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    # imported here, after parsing, so that --help answers without loading numpy and matplotlib
    from llm_agent.evaluation.analysis import parse_controller_overrides
    from llm_agent.evaluation.report import build_report
    from llm_agent.evaluation.run_data import find_latest_run, resolve_run
    from llm_agent.scenario import DEFAULT_SCENARIO_PATH, load_scenario
    from llm_agent.simulator_report.card_file import read_card

    try:
        files = resolve_run(args.run) if args.run else find_latest_run(args.outputs)
    except FileNotFoundError as exc:
        raise SystemExit(str(exc)) from None
    try:
        controller = parse_controller_overrides(args.controller)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if args.dialogues:
        files = dataclasses.replace(files, dialogues=Path(args.dialogues))
    extra = tuple(Path(h) for h in args.human if Path(h) not in files.human)
    if extra:
        files = dataclasses.replace(files, human=files.human + extra)
    cards = []
    for card in args.simulator_card:
        try:
            cards.append(read_card(card))
        except ValueError as exc:
            raise SystemExit(f"--simulator-card: {exc}") from None
    path = build_report(files, load_scenario(args.scenario or DEFAULT_SCENARIO_PATH), args.out, smooth=args.smooth,
                        bootstrap=args.bootstrap, browser_limit=args.browser_limit, controller=controller,
                        simulator_cards=cards)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
