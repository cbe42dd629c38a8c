"""Where the agent fails: CR per initial state, per combination and per behaviour, where failed calls end, and
the weights the state controller's rule would set (the original SEAD's analyze_chatbot_mistakes).

    python for_evaluation/analyze_mistakes.py outputs/rollouts/cpu_demo/rollouts.jsonl
    python for_evaluation/analyze_mistakes.py outputs/logs/cpu_demo --split train --min-step 10
    python for_evaluation/analyze_mistakes.py outputs/evaluation/cpu_demo/rl_dialogues.jsonl --out rl_mistakes.json

RUN_OR_DIALOGUES is a run (output root, log directory, rollouts.jsonl) or an evaluation's *_dialogues.jsonl.
Prints JSON (or writes it to --out) with one analysis per split: counts, CRs with Wilson 95% intervals, the
hardest and easiest combinations, failures by stage and outcome, and the controller's recommended weights.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from llm_agent.evaluation.analysis import analyze_by_split, parse_controller_overrides
from llm_agent.evaluation.run_data import read_dialogues, resolve_run
from llm_agent.scenario import DEFAULT_SCENARIO_PATH, load_scenario


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("source", metavar="RUN_OR_DIALOGUES", help="a run or a dialogues/rollouts JSONL file")
    p.add_argument("--scenario", default=str(DEFAULT_SCENARIO_PATH), help="the dialogues' scenario YAML")
    p.add_argument("--split", default=None, help="analyse only this split (train, val, ...)")
    p.add_argument("--min-step", type=int, default=None, help="first step to include")
    p.add_argument("--max-step", type=int, default=None, help="last step to include")
    p.add_argument("--min-count", type=int, default=5,
                   help="dialogues a combination needs to be ranked hardest/easiest")
    p.add_argument("--top", type=int, default=5, help="how many hardest/easiest combinations")
    p.add_argument("--controller", action="append", default=[], metavar="KEY=VALUE",
                   help="ControllerConfig override for the recommended weights, e.g. target_completion_rate=0.6")
    p.add_argument("--out", default=None, help="write the JSON here instead of stdout")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Analyse and print or write the JSON."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    try:
        files = resolve_run(args.source)
    except FileNotFoundError as exc:
        raise SystemExit(str(exc)) from None
    try:
        controller = parse_controller_overrides(args.controller)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if files.dialogues is None:
        raise SystemExit(f"{args.source}: no dialogues found (rollouts.jsonl or *_dialogues.jsonl)")
    try:
        result = analyze_by_split(read_dialogues(files.dialogues), load_scenario(args.scenario), split=args.split,
                                  min_step=args.min_step, max_step=args.max_step, min_count=args.min_count,
                                  top_k=args.top, controller=controller)
    except ValueError as exc:  # a bad line, split or controller key: the message names it
        raise SystemExit(str(exc)) from None
    text = json.dumps({"source": str(files.dialogues), **result}, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
        print(args.out)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
