"""Evaluate agents on the fixed test set against user simulators; resumable.

    python for_evaluation/evaluate.py --agent outputs/checkpoints/cpu_demo \\
        --test-file outputs/prompt_data/cpu_demo/test.parquet --out outputs/evaluation/cpu_demo
    python for_evaluation/evaluate.py --agent sft=models/sft --agent rl=ckpts/global_step_200 \\
        --agent gpt=https://api.example.com --tokenizer models/sft --agent-model gpt-4o-mini \\
        --user-sim-urls http://127.0.0.1:5000,http://127.0.0.1:5001

An agent is `[NAME=]SPEC`: a Hugging Face model directory, a checkpoint (`global_step_N`, its `actor/`, or a
checkpoint root: the latest complete step; with or without its HF export; a LoRA run's: its base with the adapter
merged), a LoRA adapter directory (`adapter_config.json` naming a local base model, e.g. `python -m
verl.model_merger --adapter_only`'s output) or a merged one, generating through the trainer's
`vLLMRollout` or `HFRollout` (--engine; auto = vLLM when it is installed), an OpenAI-compatible endpoint
`http(s)://...` (with --tokenizer), or `scripted:good|bad|malformed|ender` (the scripted stand-in, with
--tokenizer). Without --user-sim-urls it starts
--num-sims scripted simulators on loopback and stops exactly those. Per agent it writes
`<out>/<name>_dialogues.jsonl` (appended chunk by chunk; a rerun runs only missing dialogues) and
`<out>/<name>_results.json` (every metric with its bootstrap CI). Compare them with for_evaluation/metrics_table.py.

API keys never go on the command line (every local user can read it in /proc/PID/cmdline): the simulators' from
$SEAD_USER_SIM_API_KEY or --sim-api-key-file PATH, the agent endpoint's from $SEAD_AGENT_API_KEY or
--agent-api-key-file PATH (files of mode 0600). No key is written to a file or printed.
"""
from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path

from llm_agent.api_keys import api_key, command_line_refusal
from llm_agent.evaluation.agents import AgentSpec, LocalEngineOptions, build_agent
from llm_agent.evaluation.local_agents import ENGINES, pick_engine
from llm_agent.evaluation.runner import EvalSettings, evaluate_agent
from llm_agent.evaluation.sims import LocalSimulators
from llm_agent.rollout.config import GenerationConfig, resolve_path
from llm_agent.scenario import DEFAULT_SCENARIO_PATH, load_scenario
from llm_agent.user_sim.client import UserSimConfig, parse_urls

SIM_KEY_ENV = "SEAD_USER_SIM_API_KEY"
AGENT_KEY_ENV = "SEAD_AGENT_API_KEY"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring); defaults mirror sead_trainer.yaml's rollout_loop.config."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--agent", action="append", required=True, metavar="[NAME=]SPEC", help="agent to evaluate (repeatable)")
    p.add_argument("--test-file", default="outputs/prompt_data/cpu_demo/test.parquet", help="test parquet")
    p.add_argument("--scenario", default=str(DEFAULT_SCENARIO_PATH), help="scenario YAML")
    p.add_argument("--out", default="outputs/evaluation", help="output directory")
    p.add_argument("--user-sim-urls", default=None, help="running simulators (comma-separated base URLs)")
    p.add_argument("--num-sims", type=int, default=2, help="scripted simulators to start without --user-sim-urls")
    p.add_argument("--max-dialogues", type=int, default=1000, help="first N test profiles")
    p.add_argument("--chunk-size", type=int, default=64, help="dialogues run concurrently (and appended) at once")
    p.add_argument("--max-turns", type=int, default=GenerationConfig.max_turns)
    p.add_argument("--max-tokens-per-turn", type=int, default=GenerationConfig.max_tokens_per_turn)
    p.add_argument("--max-response-length", type=int, default=GenerationConfig.max_response_length,
                   help="per-dialogue token budget")
    p.add_argument("--max-user-tokens", type=int, default=GenerationConfig.max_user_tokens)
    p.add_argument("--max-prompt-length", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0, help="simulator request seeds and bootstrap seed")
    p.add_argument("--sim-temperature", type=float, default=UserSimConfig.temperature)
    p.add_argument("--sim-top-p", type=float, default=UserSimConfig.top_p)
    p.add_argument("--sim-max-tokens", type=int, default=UserSimConfig.max_tokens)
    p.add_argument("--sim-timeout-s", type=float, default=UserSimConfig.timeout_s)
    p.add_argument("--sim-max-attempts", type=int, default=UserSimConfig.max_attempts)
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
    p.add_argument("--micro-batch-size", type=int, default=None, help="rows per generate() of a local model (hf)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.8, help="vLLM's share of the GPU (vllm)")
    p.add_argument("--retry-errors", action="store_true", help="rerun dialogues whose last run ended in error")
    p.add_argument("--n-resamples", type=int, default=1000, help="bootstrap resamples")
    p.add_argument("--confidence", type=float, default=0.95)
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def checkpoint_step(spec: str) -> int:
    """N of a `global_step_N` in the spec's path, else 0."""
    match = re.search(r"global_step_(\d+)", spec)
    return int(match.group(1)) if match else 0


def run(args: argparse.Namespace) -> list[Path]:
    """Evaluate every agent; returns the results files."""
    sim_key = api_key(SIM_KEY_ENV, args.sim_api_key_file, "--sim-api-key-file")
    agent_key = api_key(AGENT_KEY_ENV, args.agent_api_key_file, "--agent-api-key-file")
    specs = [AgentSpec.parse(a) for a in args.agent]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"agent names must differ, got {names}; name them with NAME=SPEC")
    scenario_path = resolve_path(args.scenario)  # the working directory, then the repository root
    if scenario_path is None:
        raise ValueError(f"--scenario {args.scenario!r}: file not found")
    scenario = load_scenario(scenario_path)
    settings = EvalSettings(
        scenario=str(scenario_path), test_file=args.test_file, max_dialogues=args.max_dialogues,
        max_prompt_length=args.max_prompt_length, max_turns=args.max_turns,
        max_tokens_per_turn=args.max_tokens_per_turn, max_response_length=args.max_response_length,
        max_user_tokens=args.max_user_tokens, seed=args.seed,
        user_sim={"temperature": args.sim_temperature, "top_p": args.sim_top_p, "max_tokens": args.sim_max_tokens,
                  "timeout_s": args.sim_timeout_s, "max_attempts": args.sim_max_attempts, "model": args.sim_model})
    local = LocalEngineOptions(engine=pick_engine(args.engine), micro_batch_size=args.micro_batch_size,
                               max_model_len=args.max_prompt_length + args.max_response_length,
                               gpu_memory_utilization=args.gpu_memory_utilization)
    sims = None
    if args.user_sim_urls:
        urls = parse_urls(args.user_sim_urls)
    else:
        sims = LocalSimulators(args.num_sims, str(scenario_path), Path(args.out) / "user_sims", seed=args.seed)
        urls = sims.start()
    written = []
    try:
        for spec in specs:
            agent, tokenizer = build_agent(spec.spec, scenario, tokenizer_path=args.tokenizer,
                                           agent_model=args.agent_model, api_key=agent_key,
                                           concurrency=args.agent_concurrency, local=local)
            try:
                summary = evaluate_agent(spec.name, agent, tokenizer, settings, args.out, user_sim_urls=urls,
                                         chunk_size=args.chunk_size, retry_errors=args.retry_errors,
                                         n_resamples=args.n_resamples, confidence=args.confidence,
                                         agent_description=spec.describe(local.engine),
                                         step=checkpoint_step(spec.spec), user_sim_api_key=sim_key)
            finally:
                if hasattr(agent, "close"):
                    agent.close()
            cr = summary.results["metrics"]["completion_rate"]
            print(f"{spec.name}: {summary.n_selected} dialogues ({summary.n_resumed} resumed, {summary.n_run} run), "
                  f"CR {cr['value']:.3f} [{cr['low']:.3f}, {cr['high']:.3f}]")
            print(f"  dialogues: {summary.dialogues_file}\n  results:   {summary.results_file}")
            written.append(summary.results_file)
    finally:
        if sims is not None:
            sims.stop()
    return written


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
