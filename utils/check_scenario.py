"""Check one scenario file against everything a training run needs from it, in about a second.

The scripts run this first (before building, warm-starting or starting anything): the scenario file must load
(`docs/scenario_schema.md`; errors name the file, the key path and, for a misspelt key, the key meant), and with
the controller's default `profile_source=rules` every behaviour category of its library must have an entry in the
behaviour rule table. Only the file named is read, so a broken draft beside it in `format_prompt/` does not
matter. A scenario name (`inbound_support`) stands for the shipped `format_prompt/<name>.yaml`.

    python -m utils.check_scenario path/to/mine.yaml [--rules PATH]   # or a shipped name: inbound_support
    -> scenario mine: ok (4 stages, 99 behaviours in 14 categories, each with a rule in assets/behavior_rules.yaml)

Exit status 0 when the run can use it, 2 with the reason on stderr otherwise.
"""
from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from llm_agent.profiles.rules import DEFAULT_RULES_PATH, load_rule_table
from llm_agent.scenario import DEFAULT_SCENARIO_PATH, SCENARIO_DIR, Scenario, ScenarioError, load_scenario


def resolve_scenario(name_or_path: str) -> Path:
    """The scenario file `name_or_path` names (a path, or a shipped scenario's name); FileNotFoundError with the
    closest shipped names when there is none."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = SCENARIO_DIR / f"{name_or_path}.yaml"
    if shipped.is_file():
        return shipped
    known = sorted(p.stem for p in SCENARIO_DIR.glob("*.yaml"))
    close = difflib.get_close_matches(path.stem, known, n=1)
    hint = f" (did you mean {SCENARIO_DIR / (close[0] + '.yaml')}?)" if close else ""
    raise FileNotFoundError(f"scenario {name_or_path!r}: no such file{hint}; shipped scenarios: {', '.join(known)}")


def check_scenario(name_or_path: str, rules_path: str | Path | None = None, use_rules: bool = True) -> Scenario:
    """Load the scenario and, when `use_rules`, check that the rule table (default `assets/behavior_rules.yaml`)
    has an entry for each of its behaviour categories; raises ScenarioError, FileNotFoundError or ValueError
    (each naming the file) on the first problem."""
    scenario = load_scenario(resolve_scenario(name_or_path))
    if use_rules:
        table = load_rule_table(rules_path)
        table.check_library(scenario.behaviors, where=f"behaviour library of scenario {scenario.path}",
                            dims=scenario.dims)
    return scenario


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: 0 and a one-line summary when the scenario is usable, else 2 and the reason."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", nargs="?", default=str(DEFAULT_SCENARIO_PATH),
                        help="scenario YAML path or shipped scenario name (default: the default scenario)")
    parser.add_argument("--rules", default=None,
                        help=f"behaviour rule table (controller.rules_path; default {DEFAULT_RULES_PATH})")
    parser.add_argument("--profile-source", default="rules", choices=("uniform", "rules", "pool"),
                        help="controller.profile_source: the rule table is checked unless it is uniform")
    parser.add_argument("--for-scripts", action="store_true",
                        help="then print the scenario file's absolute path and its compact agent prompt, one line "
                             "each (what scripts/main.sh reads)")
    args = parser.parse_args(argv)
    use_rules = args.profile_source != "uniform"
    try:
        scenario = check_scenario(args.scenario, args.rules, use_rules)
    except (ScenarioError, FileNotFoundError, ValueError) as exc:
        print(f"scenario check failed: {exc}", file=sys.stderr)
        return 2
    categories = sorted({b.category for b in scenario.behaviors})
    rules = f", each with a rule in {args.rules or DEFAULT_RULES_PATH}" if use_rules else ""
    print(f"scenario {scenario.name}: ok ({len(scenario.stages)} stages, {len(scenario.behaviors)} behaviours in "
          f"{len(categories)} categories{rules})")
    if args.for_scripts:
        print(Path(scenario.path).resolve())
        print(scenario.agent_compact_prompt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
