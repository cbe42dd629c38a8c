"""Benchmark: how many sampled user profiles contradict the behaviour rule table, by how they were written.

    python -m bench.profile_consistency [--n 1000] [--seed 0] [--out bench/results/profile_consistency.json]

Over `--n` profiles of the outbound_ad_trial scenario (states from uniform controller weights, extremes
excluded, 1-3 behaviours), the share with at least one behaviour whose category the rule table
(assets/behavior_rules.yaml) marks as contradicting the profile's state, for:

- uniform: the state controller's draw before this rule table existed (`profile_source=uniform`);
- rules: the controller's online rule filter (`profile_source=rules`);
- llm: utils/generate_profiles.py against the scripted OpenAI-compatible endpoint
  (`llm_agent.stand_ins.profile_llm`, a real HTTP server on 127.0.0.1) answering well (its own keyword judgement,
  not the rule table), with the writer's rule check off, so the share is the endpoint's own;
- llm+repair: the same with the writer's default rule check (contradicting choices dropped, answer rejected when
  too few are left);
- llm mixed+repair: the endpoint answering 30% of requests badly (malformed, changed scores, invented or
  near-verbatim behaviours, too many), with the rule check: rejected answers and rule fallbacks counted.

Also per category (uniform draw) and the writer's time per profile (concurrency 8).
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from collections import Counter
from pathlib import Path

from llm_agent.controller import ControllerConfig, StateController
from llm_agent.profiles.pool import read_profile_file
from llm_agent.profiles.rules import load_rule_table
from llm_agent.profiles.sources import ChatEndpoint
from llm_agent.profiles.writer import ProfileWriter, WriterSettings
from llm_agent.scenario import DEFAULT_SCENARIO_PATH, load_scenario
from llm_agent.stand_ins.profile_llm import ScriptedProfileLLM

REPO = Path(__file__).resolve().parents[1]
SCENARIO = DEFAULT_SCENARIO_PATH


def violation_share(profiles, rules, scenario) -> dict:
    """{"n", "violating", "share", "by_category"} of a list of profiles under the rule table."""
    by_category: Counter = Counter()
    violating = 0
    for p in profiles:
        found = rules.violations(p, scenario.state_ranges)
        violating += bool(found)
        by_category.update({v.behavior.category for v in found})
    return {"n": len(profiles), "violating": violating, "share": violating / len(profiles),
            "by_category": dict(by_category.most_common())}


def written(scenario, rules, n, seed, mode, rule_check, workdir) -> dict:
    """Write n profiles with the scripted endpoint in `mode`; the share, the writer's counts and its time."""
    out = Path(workdir) / f"{mode}_{rule_check}.jsonl"
    with ScriptedProfileLLM(mode, bad_share=0.3) as llm:
        endpoint = ChatEndpoint(llm.url, None, timeout_s=30)
        settings = WriterSettings(n=n, seed=seed, rule_check=rule_check, concurrency=8)
        start = time.perf_counter()
        stats = ProfileWriter(scenario, out, settings, rules, endpoint=endpoint).run()
        seconds = time.perf_counter() - start
        endpoint.close()
        requests = llm.requests
    result = violation_share(read_profile_file(out, scenario), rules, scenario)
    return {**result, "writer": stats["this_run"], "by_source": stats["by_source"], "requests": requests,
            "seconds": seconds, "ms_per_profile": 1000 * seconds / n}


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and write the JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1000, help="profiles per variant")
    p.add_argument("--seed", type=int, default=0, help="seed of the states and draws")
    p.add_argument("--out", default=str(REPO / "bench/results/profile_consistency.json"), help="result JSON")
    args = p.parse_args(argv)
    scenario, rules = load_scenario(SCENARIO), load_rule_table()
    results = {}
    for source in ("uniform", "rules"):
        ctl = StateController(ControllerConfig(profile_source=source, seed=args.seed), scenario)
        results[source] = violation_share(ctl.sample(args.n), rules, scenario)
    with tempfile.TemporaryDirectory() as workdir:
        results["llm"] = written(scenario, rules, args.n, args.seed, "good", "off", workdir)
        results["llm+repair"] = written(scenario, rules, args.n, args.seed, "good", "repair", workdir)
        results["llm mixed+repair"] = written(scenario, rules, args.n, args.seed, "mixed", "repair", workdir)
    report = {"n": args.n, "seed": args.seed, "scenario": scenario.name, "machine": platform.platform(),
              "python": platform.python_version(), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    for name, r in results.items():
        extra = f"  {r['ms_per_profile']:.1f} ms/profile, {r['requests']} requests" if "requests" in r else ""
        print(f"{name:18s} {r['violating']:5d} / {r['n']} violate ({100 * r['share']:.1f}%){extra}")
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
