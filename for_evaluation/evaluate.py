"""Evaluate agents on the fixed test set against user simulators; resumable.

    python for_evaluation/evaluate.py --agent rl=outputs/checkpoints/cpu_demo_outbound_ad_trial \\
        --out outputs/eval/cpu_demo_outbound_ad_trial
    python for_evaluation/evaluate.py --agent sft=models/sft --agent rl=ckpts/global_step_200 \\
        --agent gpt=https://api.example.com --tokenizer models/sft --agent-model gpt-4o-mini \\
        --test-file data/test.parquet --user-sim-urls http://127.0.0.1:5000,http://127.0.0.1:5001

An agent is `[NAME=]SPEC`: a Hugging Face model directory, a checkpoint (`global_step_N`, its `actor/`, or a
checkpoint root: the latest complete step; with or without its HF export; a LoRA run's: its base with the adapter
merged), a LoRA adapter directory (`adapter_config.json` naming a local base model, e.g. `python -m
verl.model_merger --adapter_only`'s output) or a merged one, generating through the trainer's
`vLLMRollout` or `HFRollout` (--engine; auto = vLLM when it is installed), an OpenAI-compatible endpoint
`http(s)://...` (with --tokenizer), or `scripted:good|bad|malformed|ender` (the scripted stand-in, with
--tokenizer). A checkpoint agent brings the settings it was trained with (its `trainer_config.json`): every
setting below that the command line leaves out (test file, scenario, turns, token limits, simulator sampling,
seed) is the run's own, so evaluating a run's checkpoint repeats its validation; the rest keep the rollout loop's
defaults. Without --user-sim-urls it starts --num-sims scripted simulators on loopback and stops exactly those.
Per agent it writes `<out>/<name>_dialogues.jsonl` (appended chunk by chunk; a rerun runs only missing dialogues)
and `<out>/<name>_results.json` (every metric with its bootstrap interval, the checkpoint's global_step, where
each setting came from). Compare them with for_evaluation/metrics_table.py.

Cross-judge evaluation: `--judge NAME=URLS` (repeatable, instead of --user-sim-urls) grades every agent under each
simulator set on the same profiles and seeds, into `<out>/NAME/`, and prints (and writes as
`<out>/cross_judge.{txt,md,csv,json}`) the metrics of every agent@judge side by side with the CR difference
between judges paired by profile and the dialogues only one judge let complete (docs/simulator.md).

API keys never go on the command line (every local user can read it in /proc/PID/cmdline): the simulators' from
$SEAD_USER_SIM_API_KEY or --sim-api-key-file PATH, the agent endpoint's from $SEAD_AGENT_API_KEY or
--agent-api-key-file PATH (files of mode 0600). No key is written to a file or printed.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from llm_agent.api_keys import KeySafeArgumentParser, api_key, command_line_refusal
from llm_agent.evaluation.defaults import (AGENT_KEY_ENV, CHECKPOINT, DEFAULT_CONFIDENCE, DEFAULT_RESAMPLES, ENGINES,
                                           MAX_PROMPT_LENGTH, SIM_KEY_ENV)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring). Settings left None are resolved by `resolve_settings`."""
    p = KeySafeArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--agent", action="append", required=True, metavar="[NAME=]SPEC", help="agent to evaluate (repeatable)")
    p.add_argument("--test-file", default=None, help=f"test parquet ({CHECKPOINT}required)")
    p.add_argument("--scenario", default=None, help=f"scenario YAML ({CHECKPOINT}the default scenario)")
    p.add_argument("--out", default="outputs/eval", help="output directory (its own: the trainer's validation "
                   "metrics are under outputs/evaluation/)")
    p.add_argument("--user-sim-urls", default=None, help="running simulators (comma-separated base URLs)")
    p.add_argument("--judge", action="append", default=None, metavar="NAME=URLS",
                   help="grade every agent under this simulator set too (repeatable; instead of --user-sim-urls)")
    p.add_argument("--num-sims", type=int, default=2, help="scripted simulators to start without --user-sim-urls")
    p.add_argument("--max-dialogues", type=int, default=1000, help="first N test profiles")
    p.add_argument("--chunk-size", type=int, default=64, help="dialogues run concurrently (and appended) at once")
    loop = f"{CHECKPOINT}the rollout loop's"
    p.add_argument("--max-turns", type=int, default=None, help=loop)
    p.add_argument("--max-tokens-per-turn", type=int, default=None, help=loop)
    p.add_argument("--max-response-length", type=int, default=None, help=f"per-dialogue token budget ({loop})")
    p.add_argument("--max-user-tokens", type=int, default=None, help=loop)
    p.add_argument("--max-prompt-length", type=int, default=None, help=f"{CHECKPOINT}{MAX_PROMPT_LENGTH}")
    p.add_argument("--seed", type=int, default=None, help=f"simulator request seeds and bootstrap seed ({loop})")
    sim = f"{CHECKPOINT}the simulator client's"
    p.add_argument("--sim-temperature", type=float, default=None, help=sim)
    p.add_argument("--sim-top-p", type=float, default=None, help=sim)
    p.add_argument("--sim-max-tokens", type=int, default=None, help=sim)
    p.add_argument("--sim-timeout-s", type=float, default=None, help=sim)
    p.add_argument("--sim-max-attempts", type=int, default=None, help=sim)
    p.add_argument("--sim-model", default=None, help="model name the simulators answer to (null: discovered)")
    p.add_argument("--sim-api-key", default=None, help=argparse.SUPPRESS)
    p.add_argument("--sim-api-key-file", default=None,
                   help=f"file (mode 0600) holding the simulators' API key; or set {SIM_KEY_ENV}")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir for endpoint and scripted agents")
    p.add_argument("--agent-model", default=None, help="model name at the agent endpoint (null: its first)")
    p.add_argument("--agent-api-key", default=None, help=argparse.SUPPRESS)
    p.add_argument("--agent-api-key-file", default=None,
                   help=f"file (mode 0600) holding the agent endpoint's API key; or set {AGENT_KEY_ENV}")
    p.add_argument("--agent-concurrency", type=int, default=16, help="parallel requests to an agent endpoint")
    p.add_argument("--engine", choices=ENGINES, default="auto",
                   help="how a model/checkpoint agent generates: the trainer's vLLMRollout (vllm) or HFRollout (hf); "
                        "auto = vllm when it is installed")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="open checkpoint agents that have no checkpoint_manifest.json (from elsewhere, or saved before "
                        "manifests): only if you trust where they came from (docs/checkpoints.md)")
    p.add_argument("--micro-batch-size", type=int, default=None, help="rows per generate() of a local model (hf)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.8, help="vLLM's share of the GPU (vllm)")
    p.add_argument("--retry-errors", action="store_true", help="rerun dialogues whose last run ended in error")
    p.add_argument("--n-resamples", type=int, default=DEFAULT_RESAMPLES, help="bootstrap resamples per interval")
    p.add_argument("--confidence", type=float, default=DEFAULT_CONFIDENCE)
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def resolve_settings(args: argparse.Namespace, checkpoints: list[tuple[str, Any]], need_test_file: bool = True
                     ) -> tuple[dict[str, Any], dict[str, str]]:
    """Every setting and where it came from (`llm_agent.evaluation.checkpoint_settings.resolve_settings`)."""
    from llm_agent.evaluation.checkpoint_settings import resolve_settings as resolve

    return resolve(args, checkpoints, need_test_file)


def run(args: argparse.Namespace) -> list[Path]:
    """Evaluate every agent; returns the results files."""
    from llm_agent.evaluation.agents import AgentSpec, LocalEngineOptions, build_agent
    from llm_agent.evaluation.checkpoint_settings import checkpoint_info
    from llm_agent.evaluation.judges import judge_dir, parse_judges
    from llm_agent.evaluation.local_agents import pick_engine
    from llm_agent.evaluation.runner import EvalSettings, evaluate_agent
    from llm_agent.evaluation.sims import LocalSimulators
    from llm_agent.rollout.config import resolve_path
    from llm_agent.scenario import load_scenario
    from llm_agent.user_sim.client import parse_urls

    engine = pick_engine(args.engine)  # an engine that is not installed is refused before anything starts
    sim_key = api_key(SIM_KEY_ENV, args.sim_api_key_file, "--sim-api-key-file")
    agent_key = api_key(AGENT_KEY_ENV, args.agent_api_key_file, "--agent-api-key-file")
    if args.judge and args.user_sim_urls:
        raise ValueError("--judge and --user-sim-urls exclude each other: name every simulator set with --judge")
    judges = parse_judges(args.judge or [])
    specs = [AgentSpec.parse(a) for a in args.agent]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"agent names must differ, got {names}; name them with NAME=SPEC")
    infos = {s.name: checkpoint_info(s.spec) if s.is_local else None for s in specs}
    values, origin = resolve_settings(args, [(name, info) for name, info in infos.items() if info is not None])
    scenario_path = resolve_path(values["scenario"])  # the working directory, then the repository root
    if scenario_path is None:
        raise ValueError(f"scenario {values['scenario']!r} ({origin['scenario']}): file not found")
    scenario = load_scenario(scenario_path)
    settings = EvalSettings(
        scenario=str(scenario_path), test_file=values["test_file"], max_dialogues=args.max_dialogues,
        max_prompt_length=values["max_prompt_length"], max_turns=values["max_turns"],
        max_tokens_per_turn=values["max_tokens_per_turn"], max_response_length=values["max_response_length"],
        max_user_tokens=values["max_user_tokens"], seed=values["seed"],
        user_sim={"temperature": values["sim_temperature"], "top_p": values["sim_top_p"],
                  "max_tokens": values["sim_max_tokens"], "timeout_s": values["sim_timeout_s"],
                  "max_attempts": values["sim_max_attempts"], "model": args.sim_model})
    from_checkpoint = sorted(name for name, where in origin.items() if where not in ("command line", "default"))
    if from_checkpoint:
        print("settings from the checkpoint's training config: "
              + ", ".join(f"{name}={values[name]}" for name in from_checkpoint))
    local = LocalEngineOptions(engine=engine, micro_batch_size=args.micro_batch_size,
                               max_model_len=settings.max_prompt_length + settings.max_response_length,
                               gpu_memory_utilization=args.gpu_memory_utilization,
                               trust_checkpoint=args.trust_checkpoint)
    sims = None
    if judges:
        runs = [(judge.name, list(judge.urls), judge_dir(args.out, judge.name)) for judge in judges]
    elif args.user_sim_urls:
        runs = [(None, parse_urls(args.user_sim_urls), Path(args.out))]
    else:
        sims = LocalSimulators(args.num_sims, str(scenario_path), Path(args.out) / "user_sims", seed=settings.seed)
        runs = [(None, sims.start(), Path(args.out))]
    written = []
    try:
        for spec in specs:
            info = infos[spec.name]
            # a checkpoint root is read at the step resolved above, even if training saves a newer one meanwhile
            agent, tokenizer = build_agent(str(info.step_dir) if info else spec.spec, scenario,
                                           tokenizer_path=args.tokenizer, agent_model=args.agent_model,
                                           api_key=agent_key, concurrency=args.agent_concurrency,
                                           local=local)
            try:
                for judge, urls, out in runs:
                    summary = evaluate_agent(spec.name, agent, tokenizer, settings, out, user_sim_urls=urls,
                                             chunk_size=args.chunk_size, retry_errors=args.retry_errors,
                                             n_resamples=args.n_resamples, confidence=args.confidence,
                                             agent_description=spec.describe(local.engine),
                                             step=info.global_step if info else 0,
                                             checkpoint=str(info.step_dir) if info else None, settings_origin=origin,
                                             user_sim_api_key=sim_key)
                    _print_summary(summary, info, judge, args.confidence)
                    written.append(summary.results_file)
            finally:
                agent.close()
    finally:
        if sims is not None:
            sims.stop()
    if judges:
        _cross_judge(args, [s.name for s in specs], [j.name for j in judges], settings.seed)
    return written


def _print_summary(summary: Any, info: Any, judge: str | None, confidence: float) -> None:
    """What one agent's evaluation (under `judge`, if any) ran and its CR, ATT and ADT with intervals."""
    from llm_agent.metrics import NOT_AVAILABLE

    at = f" at global_step {info.global_step}" if info else ""
    under = f" under judge {judge}" if judge else ""
    print(f"{summary.name}{at}{under}: {summary.n_selected} dialogues ({summary.n_resumed} resumed, "
          f"{summary.n_run} run)")
    for key, label in (("completion_rate", "CR"), ("att", "ATT"), ("adt", "ADT")):
        m = summary.results["metrics"][key]
        interval = "" if m["low"] is None else f" [{confidence:.0%} interval {m['low']:.3f}, {m['high']:.3f}]"
        value = NOT_AVAILABLE if m["value"] is None else f"{m['value']:.3f}{interval}"
        print(f"  {label} {value}")
    print(f"  dialogues: {summary.dialogues_file}\n  results:   {summary.results_file}")


def _cross_judge(args: argparse.Namespace, agents: list[str], judges: list[str], seed: int) -> None:
    """Print every agent@judge side by side with the paired judge comparisons; write them as
    `<out>/cross_judge.{txt,md,csv,json}`."""
    from llm_agent.evaluation.judges import cross_judge_table, write_summary
    from llm_agent.evaluation.table import render

    table = cross_judge_table(args.out, agents, judges, args.n_resamples, args.confidence, seed)
    out = Path(args.out)
    for fmt, suffix in (("terminal", "txt"), ("markdown", "md"), ("csv", "csv")):
        (out / f"cross_judge.{suffix}").write_text(render(table, fmt))
    write_summary(out / "cross_judge.json", table)
    print(render(table, "terminal"), end="")
    print(f"cross-judge table: {out / 'cross_judge.txt'} (.md, .csv, .json)")


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point; bad input exits with a one-line error."""
    args = parse_args(argv)
    for flag, env_var in (("--sim-api-key", SIM_KEY_ENV), ("--agent-api-key", AGENT_KEY_ENV)):
        if getattr(args, flag.removeprefix("--").replace("-", "_")) is not None:
            raise SystemExit(f"evaluate: {command_line_refusal(flag, env_var)}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run(args)
    except (ValueError, OSError, RuntimeError) as exc:
        raise SystemExit(f"evaluate: {exc}") from None


if __name__ == "__main__":
    main()
