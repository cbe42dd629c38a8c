"""Write believable user profiles: sampled states whose behaviours an LLM (or the rule table) chooses to fit.

    python -m utils.generate_profiles --n 1000 --out outputs/profiles/next.jsonl \\
        [--weights outputs/iterations/cpu_demo/iter_01/mistakes.json] \\
        [--llm-url http://127.0.0.1:8000/v1 --llm-model Qwen2.5-14B-Instruct] [--concurrency 16]

States come from --weights (a mistakes analysis JSON, a checkpoint's trainer_state.json or global_step_N
directory, or {group: {label: weight}}; uniform without it), never changed afterwards. With --llm-url any
OpenAI-compatible endpoint chooses the behaviours from the scenario's library (answers checked, repaired or
rejected, every rejected answer kept in OUT.rejected.jsonl); without it, or when it keeps failing, the rule
table (assets/behavior_rules.yaml) draws them. A killed run resumes with the same command. The counts go to
OUT.stats.json and stdout; the last line printed is OUT. Use the file as a pool
(rollout_loop.config.controller.profile_source=pool pool_path=OUT) or as prompt data
(utils/create_prompt_data.py --profiles OUT).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from llm_agent.profiles.rules import DEFAULT_RULES_PATH, load_rule_table
from llm_agent.profiles.sources import ChatEndpoint, load_weights
from llm_agent.profiles.writer import RULE_CHECKS, ProfileWriter, WriterSettings
from llm_agent.scenario import DEFAULT_SCENARIO_PATH, load_scenario


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--scenario", default=str(DEFAULT_SCENARIO_PATH), help="scenario YAML (ranges and library)")
    p.add_argument("--n", type=int, required=True, help="number of profiles")
    p.add_argument("--out", required=True, help="output JSONL (resumed when it exists)")
    p.add_argument("--weights", default=None, help="sampling weights file (default: uniform)")
    p.add_argument("--weights-split", default=None, help="split of a mistakes analysis to take weights from")
    p.add_argument("--seed", type=int, default=0, help="seed of the states and the rule draws")
    p.add_argument("--min-behaviors", type=int, default=1, help="fewest behaviours per profile")
    p.add_argument("--max-behaviors", type=int, default=3, help="most behaviours per profile")
    p.add_argument("--allow-extremes", action="store_true", help="also draw the extreme state values")
    p.add_argument("--rules", default=str(DEFAULT_RULES_PATH), help="behaviour rule table YAML")
    p.add_argument("--rule-check", choices=RULE_CHECKS, default="repair",
                   help="repair: drop LLM-chosen behaviours the rule table rejects; off: keep the LLM's choice")
    p.add_argument("--llm-url", default=os.environ.get("PROFILE_LLM_URL") or None,
                   help="OpenAI-compatible base URL (env PROFILE_LLM_URL); none: the rule table writes all")
    p.add_argument("--llm-model", default=os.environ.get("PROFILE_LLM_MODEL", "default"), help="model name")
    p.add_argument("--api-key-env", default="OPENAI_API_KEY", help="environment variable holding the API key")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature of the LLM")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per LLM request")
    p.add_argument("--max-attempts", type=int, default=3, help="LLM attempts per profile before the rule table")
    p.add_argument("--concurrency", type=int, default=8, help="LLM requests in flight")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Write the profiles; print the counts and the output path."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    endpoint = None
    try:
        scenario = load_scenario(args.scenario)
        settings = WriterSettings(n=args.n, seed=args.seed, min_behaviors=args.min_behaviors,
                                  max_behaviors=args.max_behaviors, allow_extremes=args.allow_extremes,
                                  rule_check=args.rule_check, max_attempts=args.max_attempts,
                                  concurrency=args.concurrency)
        weights = load_weights(args.weights, args.weights_split) if args.weights else None
        if args.llm_url:
            endpoint = ChatEndpoint(args.llm_url, args.llm_model, os.environ.get(args.api_key_env),
                                    timeout_s=args.timeout, temperature=args.temperature)
        writer = ProfileWriter(scenario, args.out, settings, load_rule_table(args.rules), weights, endpoint)
        stats = writer.run()
    except (ValueError, OSError) as exc:
        raise SystemExit(f"generate_profiles: {exc}") from None
    finally:
        if endpoint is not None:
            endpoint.close()
    print(json.dumps(stats, indent=1))
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
