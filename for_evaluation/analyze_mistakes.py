"""Where the agent fails: CR per initial state, per combination and per behaviour, where failed calls end, and
the weights the state controller's rule would set (the original SEAD's analyze_chatbot_mistakes).

    python for_evaluation/analyze_mistakes.py                     # the latest run under outputs/ (after make demo)
    python for_evaluation/analyze_mistakes.py outputs/logs/cpu_demo_outbound_ad_trial --split train --min-step 10
    python for_evaluation/analyze_mistakes.py outputs/eval/cpu_demo_outbound_ad_trial/rl_dialogues.jsonl \\
        --out rl_mistakes.json

RUN_OR_DIALOGUES is a run (output root, log directory, rollouts.jsonl) or an evaluation's *_dialogues.jsonl;
without it, the latest run under --outputs. Prints a summary per split (outcomes, CR with its Wilson 95%
interval, the hardest and easiest initial states, behaviour categories, where failed calls ended); the whole
analysis (every combination and behaviour, the controller's recommended weights) as JSON with --json (stdout)
or --out FILE.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from llm_agent.evaluation.defaults import DEFAULT_OUTPUTS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("source", metavar="RUN_OR_DIALOGUES", nargs="?", default=None,
                   help="a run or a dialogues/rollouts JSONL file; default: the latest run under --outputs")
    p.add_argument("--outputs", default=DEFAULT_OUTPUTS, help="main.sh output root searched when no run is given")
    p.add_argument("--scenario", default=None, help="the dialogues' scenario YAML (default: the demo's)")
    p.add_argument("--split", default=None, help="analyse only this split (train, val, ...)")
    p.add_argument("--min-step", type=int, default=None, help="first step to include")
    p.add_argument("--max-step", type=int, default=None, help="last step to include")
    p.add_argument("--min-count", type=int, default=5,
                   help="dialogues a combination needs to be ranked hardest/easiest")
    p.add_argument("--top", type=int, default=5, help="how many hardest/easiest combinations")
    p.add_argument("--controller", action="append", default=[], metavar="KEY=VALUE",
                   help="ControllerConfig override for the recommended weights, e.g. target_completion_rate=0.6")
    p.add_argument("--json", action="store_true", help="print the whole analysis as JSON instead of the summary")
    p.add_argument("--out", default=None, help="write the whole analysis as JSON to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Analyse; print the summary, or the JSON (--json), or write the JSON (--out) and print its path."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    # imported here, after parsing, so that --help answers without loading the analysis' dependencies
    from llm_agent.evaluation.analysis import analyze_by_split, parse_controller_overrides
    from llm_agent.evaluation.mistakes_text import mistakes_summary
    from llm_agent.evaluation.run_data import find_latest_run, read_dialogues, resolve_run
    from llm_agent.scenario import DEFAULT_SCENARIO_PATH, load_scenario

    try:
        files = resolve_run(args.source) if args.source else find_latest_run(args.outputs)
    except FileNotFoundError as exc:
        raise SystemExit(str(exc)) from None
    try:
        controller = parse_controller_overrides(args.controller)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if files.dialogues is None:
        raise SystemExit(f"{args.source or files.name}: no dialogues found (rollouts.jsonl or *_dialogues.jsonl)")
    try:
        scenario = load_scenario(args.scenario or DEFAULT_SCENARIO_PATH)
        result = analyze_by_split(read_dialogues(files.dialogues), scenario, split=args.split, min_step=args.min_step,
                                  max_step=args.max_step, min_count=args.min_count, top_k=args.top,
                                  controller=controller)
    except ValueError as exc:  # a bad line, split or controller key: the message names it
        raise SystemExit(str(exc)) from None
    result = {"source": str(files.dialogues), **result}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(args.out)
    elif args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"dialogues: {files.dialogues}\n{mistakes_summary(result, args.top)}")
        print("(every combination and behaviour, and the controller's recommended weights: --json or --out FILE)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
