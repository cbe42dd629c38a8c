"""The user-simulator report card: how well a simulator plays the scenario's users, with bootstrap intervals.

    python -m for_evaluation.simulator_report --user-sim-urls http://127.0.0.1:5000 --name sft-tiny
    python -m for_evaluation.simulator_report --scripted --name scripted          # the in-process scripted persona
    python -m for_evaluation.simulator_report --dialogues outputs/rollouts/cpu_demo/rollouts.jsonl --split train
    python -m for_evaluation.simulator_report --card before.json --card after.json --html compare.html

A live simulator (any OpenAI-compatible endpoint: our server, vLLM, a hosted model; the bearer key from
SEAD_USER_SIM_API_KEY) answers the fixed probes (`--probe-dialogues` scripted calls from `--probe-seed`: the same
profiles and agent turns for every simulator) with the rollout loop's decoding settings, malformed replies
re-requested as the loop does. A file of logged dialogues (a rollout log or an evaluation's dialogues) is graded
turn by turn instead. Either way each reply is checked against the scripted persona answering the same request
(llm_agent/simulator_report). Human calls in the file (`judge: human`, from `python -m for_evaluation.chat`) are
not simulator turns: the card's `human` section says how the scripted persona's and the simulator's answers to
the same requests (the records' `previews`) agree with the person's (llm_agent/simulator_report/human.py).
Prints the metrics side by side with `--card` files given, writes the card as JSON (`--out`, default
outputs/simulator_reports/<name>.json; a log's card is named after its run and split, so two runs' cards do not
overwrite each other) and, with `--html`, a page of all cards; the run report shows cards
with `python -m for_evaluation.report ... --simulator-card FILE`.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from llm_agent.evaluation.report_simulator import render_simulator_page
from llm_agent.evaluation.run_data import read_dialogues
from llm_agent.scenario import DEFAULT_SCENARIO_PATH, load_scenario
from llm_agent.simulator_report import (PROBE_SEED, ProbeSampling, build_card, build_probe_set, dialogues_from_log,
                                        run_probes)
from llm_agent.simulator_report.card import AGENT_KEYS, METRIC_KEYS
from llm_agent.simulator_report.card_file import read_card
from llm_agent.simulator_report.human import human_records, human_section
from llm_agent.user_sim.client.wire import SimulatorCheckError

logger = logging.getLogger("simulator_report")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    what = p.add_mutually_exclusive_group()
    what.add_argument("--user-sim-urls", help="comma-separated base URLs of simulator instances")
    what.add_argument("--scripted", action="store_true", help="grade the scripted persona in process")
    what.add_argument("--dialogues", help="grade the simulator turns of a rollout log / evaluation dialogues file")
    p.add_argument("--card", action="append", default=[], help="an earlier card (JSON) to show alongside")
    p.add_argument("--name", default=None, help="the card's name (default: from what is graded)")
    p.add_argument("--scenario", default=str(DEFAULT_SCENARIO_PATH), help="scenario YAML")
    p.add_argument("--model", default=None, help="served model name (default: what /v1/models lists)")
    p.add_argument("--split", default=None, help="only logged dialogues of this split (train, val, ...)")
    p.add_argument("--probe-dialogues", type=int, default=48, help="scripted calls in the probe set")
    p.add_argument("--probe-seed", type=int, default=PROBE_SEED, help="seed of the probe set")
    p.add_argument("--max-turns", type=int, default=8, help="agent turns per probe call")
    p.add_argument("--temperature", type=float, default=ProbeSampling.temperature)
    p.add_argument("--top-p", type=float, default=ProbeSampling.top_p)
    p.add_argument("--max-tokens", type=int, default=ProbeSampling.max_tokens)
    p.add_argument("--reply-retries", type=int, default=ProbeSampling.reply_retries,
                   help="re-requests of a malformed reply (the rollout loop's user_sim.reply_retries)")
    p.add_argument("--seed", type=int, default=0, help="seed of the requests and of the bootstrap")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight at once")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples (0: no intervals)")
    p.add_argument("--max-jump", type=int, default=None,
                   help="largest allowed change of a state in one turn (default: from the scenario's effects)")
    p.add_argument("--out", default=None, help="the card's JSON file")
    p.add_argument("--html", default=None, help="write a page with every card")
    return p.parse_args(argv)


def _live_card(args: argparse.Namespace, scenario: Any, name: str) -> dict[str, Any]:
    """Run the probes on the simulator the arguments name and grade them."""
    from llm_agent.stand_ins.inprocess_user_sim import InProcessUserSim
    from llm_agent.user_sim.client import UserSimClient

    probes = build_probe_set(scenario, args.probe_dialogues, args.probe_seed, max_turns=args.max_turns)
    sampling = ProbeSampling(args.temperature, args.top_p, args.max_tokens, args.reply_retries, args.seed)
    if args.scripted:
        client, source = InProcessUserSim(scenario, seed=args.seed), {"kind": "scripted (in process)"}
    else:
        client = UserSimClient(args.user_sim_urls, model=args.model, timeout_s=args.timeout)
        source = {"kind": "endpoint", "instances": ",".join(client.instances)}
    with client:  # closed on every path, a failed check included
        if not args.scripted:
            source["model"] = ",".join(sorted(set(client.check_instances().values())))
        dialogues = run_probes(client, probes, scenario, sampling, args.concurrency)
    source.update({"sampling": vars(sampling), "probes": probes.describe()})
    return build_card(dialogues, scenario, name, source, n_resamples=args.bootstrap, seed=args.seed,
                      max_jump=args.max_jump)


def _log_card(args: argparse.Namespace, scenario: Any, name: str) -> dict[str, Any]:
    """Grade the simulator turns of a dialogues file."""
    records = read_dialogues(args.dialogues)
    if args.split is not None:
        records = [r for r in records if r.split == args.split]
    humans = human_records(records)
    person = {id(r) for r in humans}
    dialogues = dialogues_from_log([r for r in records if id(r) not in person], scenario)
    source = {"kind": "logged dialogues", "path": args.dialogues, "split": args.split or "all"}
    human = human_section(humans, scenario, n_resamples=args.bootstrap, seed=args.seed)
    return build_card(dialogues, scenario, name, source, n_resamples=args.bootstrap, seed=args.seed,
                      max_jump=args.max_jump, human=human)


def log_card_name(dialogues: str, split: str | None) -> str:
    """A log's card name: the run's (a rollout log `<root>/rollouts/<run>/rollouts.jsonl` is named after `<run>`,
    an evaluation's `<name>_dialogues.jsonl` after `<name>`), with the split when one is chosen."""
    path = Path(dialogues)
    name = path.parent.name if path.stem == "rollouts" and path.parent.name else path.stem
    return f"{name}_{split}" if split else name


def _cell(value: Any) -> str:
    def number(value: Any) -> str:
        return "-" if value is None else f"{value:.3f}"

    if isinstance(value, dict):
        return f"{number(value.get('value'))} [{number(value.get('low'))}, {number(value.get('high'))}]"
    return number(value)


def _aligned(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows)


def cards_table(cards: list[dict[str, Any]]) -> str:
    """The cards' metrics side by side as text: value [low, high] per card; then, for probe cards, the agreement
    per probing agent quality; then, for cards graded on human calls, the agreement of each preview source with
    the person's turns."""
    names = [str(c.get("name")) for c in cards]
    text = _aligned([["metric", *names]] + [[key, *(_cell(c["metrics"].get(key)) for c in cards)]
                                            for key in METRIC_KEYS])
    agents = list(dict.fromkeys(a for c in cards for a in c.get("by_agent") or {}))
    if agents:
        rows = [["by probing agent", *names]]
        for agent in agents:
            parts = [(c.get("by_agent") or {}).get(agent) or {} for c in cards]
            rows.append([f"{agent}: turns", *(str(p.get("n_turns", "-")) for p in parts)])
            rows += [[f"{agent}: {key}", *(_cell(p.get(key)) for p in parts)] for key in AGENT_KEYS]
        text += "\n\n" + _aligned(rows)
    columns = [(c, source, part) for c in cards if isinstance(c.get("human"), dict)
               and isinstance(c["human"].get("sources"), dict)
               for source, part in c["human"]["sources"].items()
               if isinstance(part, dict) and isinstance(part.get("metrics"), dict)]
    if not columns:
        return text
    keys = list(dict.fromkeys(k for _, _, part in columns for k in part["metrics"]))
    rows = [["agreement with the person", *(f"{c.get('name')}:{source}" for c, source, _ in columns)],
            ["person turns answered", *(str(part.get("n_turns")) for _, _, part in columns)]]
    rows += [[key, *(_cell(part["metrics"].get(key)) for _, _, part in columns)] for key in keys]
    return text + "\n\n" + _aligned(rows)


def main(argv: list[str] | None = None) -> int:
    """Make (or read) the cards, print them, write the JSON and the optional page."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    scenario = load_scenario(args.scenario)
    cards = []
    for path in args.card:
        try:
            cards.append(read_card(path))
        except ValueError as exc:
            raise SystemExit(f"--card: {exc}") from None
    if args.user_sim_urls or args.scripted or args.dialogues:
        name = args.name or ("scripted" if args.scripted else log_card_name(args.dialogues, args.split)
                             if args.dialogues else args.model or "endpoint")
        try:
            card = _log_card(args, scenario, name) if args.dialogues else _live_card(args, scenario, name)
        except (OSError, ValueError, SimulatorCheckError) as exc:
            raise SystemExit(f"simulator report: {exc}") from None
        out = Path(args.out or Path("outputs") / "simulator_reports" / f"{name}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(card, indent=1) + "\n", encoding="utf-8")
        print(f"card: {out}", file=sys.stderr)
        cards.append(card)
    if not cards:
        raise SystemExit("nothing to report: give --user-sim-urls, --scripted, --dialogues or --card")
    print(cards_table(cards))
    if args.html:
        Path(args.html).parent.mkdir(parents=True, exist_ok=True)
        Path(args.html).write_text(render_simulator_page(cards), encoding="utf-8")
        print(f"page: {args.html}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
