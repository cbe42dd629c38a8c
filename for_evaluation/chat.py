"""Talk to an agent yourself: a local page where you play the user and each finished call becomes an evaluation
record beside the simulator's.

    python -m for_evaluation.chat --agent rl=outputs/checkpoints/cpu_demo_outbound_ad_trial
    python -m for_evaluation.chat --agent scripted:good --tokenizer models/tiny --out outputs/eval/human

The agent is any `evaluate.py` spec (a checkpoint, an HF directory, an OpenAI-compatible endpoint with
--tokenizer, `scripted:good|bad|...` with --tokenizer); a checkpoint brings the settings it was trained with
(scenario, prompt file, turns, token limits, seed), so the agent answers with the prompt, tokens and limits of
its training. The server listens on 127.0.0.1 (another address only with --allow-remote) and prints the page's
address with a random access token; every request without it is refused. The page shows the persona to play
(a profile drawn by the state controller's sampler, seeded, or picked by hand), the dialogue, what the scripted
persona would have answered, and the controls of the protocol: the state you report after each turn and ending
the call (agreed / hung up). A local HF model's or an endpoint's answers to your turns appear as they are
written (Server-Sent Events; --no-stream: only once done; the record is the same either way). Each finished call
is appended to `<out>/human_dialogues.jsonl` in evaluate.py's record format with `judge: "human"`;
for_evaluation/report.py, metrics_table.py and analyze_mistakes.py read it.
The agent endpoint's key comes from $SEAD_AGENT_API_KEY or --agent-api-key-file, as in evaluate.py; it never
reaches the page or a record.
"""
from __future__ import annotations

import argparse
import logging
import signal
import tempfile
from pathlib import Path
from typing import Any

from llm_agent.api_keys import KeySafeArgumentParser, api_key, command_line_refusal
from llm_agent.evaluation.defaults import AGENT_KEY_ENV, CHECKPOINT, ENGINES, SIM_KEY_ENV

logger = logging.getLogger("for_evaluation.chat")

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = KeySafeArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--agent", required=True, metavar="[NAME=]SPEC", help="the agent to talk to (evaluate.py's specs)")
    p.add_argument("--scenario", default=None, help=f"scenario YAML ({CHECKPOINT}the default scenario)")
    p.add_argument("--test-file", default=None, help=f"prompt parquet whose first row's prompt the agent gets "
                   f"({CHECKPOINT}the scenario's own prompt)")
    p.add_argument("--out", default="outputs/eval/human", help="where human_dialogues.jsonl goes")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback unless --allow-remote)")
    p.add_argument("--port", type=int, default=0, help="port (0: a free one)")
    p.add_argument("--no-stream", action="store_true",
                   help="show the agent's turn only once generated (a local HF model or an endpoint streams it "
                   "by default)")
    p.add_argument("--allow-remote", action="store_true", help="allow a --host other than loopback (the token is "
                   "still required; the page is plain HTTP)")
    loop = f"{CHECKPOINT}the rollout loop's"
    for name in ("max-turns", "max-tokens-per-turn", "max-response-length", "max-user-tokens", "seed"):
        p.add_argument(f"--{name}", type=int, default=None, help=loop)
    p.add_argument("--max-prompt-length", type=int, default=None, help=f"{CHECKPOINT}4096")
    p.add_argument("--user-sim-urls", default=None, help="a running simulator (comma-separated base URLs) whose "
                   "answer to the same request the page shows beside the scripted persona's")
    p.add_argument("--sim-model", default=None, help="model name the simulators answer to (null: discovered)")
    p.add_argument("--sim-api-key", default=None, help=argparse.SUPPRESS)
    p.add_argument("--sim-api-key-file", default=None,
                   help=f"file (mode 0600) holding the simulators' API key; or set {SIM_KEY_ENV}")
    p.add_argument("--profile-seed", type=int, default=0, help="seed of the state controller's profile sampler")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir for endpoint and scripted agents")
    p.add_argument("--agent-model", default=None, help="model name at the agent endpoint (null: its first)")
    p.add_argument("--agent-api-key", default=None, help=argparse.SUPPRESS)
    p.add_argument("--agent-api-key-file", default=None,
                   help=f"file (mode 0600) holding the agent endpoint's API key; or set {AGENT_KEY_ENV}")
    p.add_argument("--engine", choices=ENGINES, default="auto", help="how a model/checkpoint agent generates")
    p.add_argument("--trust-checkpoint", action="store_true", help="open a checkpoint without a manifest")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(**{f"sim_{k}": None for k in ("temperature", "top_p", "max_tokens", "timeout_s", "max_attempts")})
    # simulator sampling: the checkpoint's training config, else the simulator client's defaults (evaluate.py's)
    return p.parse_args(argv)


def build_server(args: argparse.Namespace, work: Path) -> tuple[Any, list[Any]]:
    """(the ChatServer, what to close after it: the agent and a simulator client) for `args`; `work` holds a
    prompt file when no prompt parquet is known."""
    from llm_agent.controller import ControllerConfig, StateController
    from llm_agent.evaluation.agents import AgentSpec, LocalEngineOptions, build_agent
    from llm_agent.evaluation.chat_server import ChatServer
    from llm_agent.evaluation.checkpoint_settings import checkpoint_info, resolve_settings
    from llm_agent.evaluation.human_calls import HumanCall, scenario_prompt_file
    from llm_agent.evaluation.local_agents import pick_engine
    from llm_agent.evaluation.runner import EvalSettings
    from llm_agent.rollout.config import resolve_path
    from llm_agent.scenario import load_scenario
    from verl.utils.dataset import RLHFDataset

    if args.host not in LOOPBACK and not args.allow_remote:
        raise ValueError(f"--host {args.host} is not loopback: pass --allow-remote to listen there")
    spec = AgentSpec.parse(args.agent)
    engine = pick_engine(args.engine) if spec.is_local else args.engine
    key = api_key(AGENT_KEY_ENV, args.agent_api_key_file, "--agent-api-key-file")
    sim_key = api_key(SIM_KEY_ENV, args.sim_api_key_file, "--sim-api-key-file")
    info = checkpoint_info(spec.spec) if spec.is_local else None
    values, _ = resolve_settings(args, [(spec.name, info)] if info else [], need_test_file=False)
    scenario_path = resolve_path(values["scenario"])
    if scenario_path is None:
        raise ValueError(f"scenario {values['scenario']!r}: file not found")
    scenario = load_scenario(scenario_path)
    local = LocalEngineOptions(engine=engine, max_model_len=values["max_prompt_length"] + values["max_response_length"],
                               trust_checkpoint=args.trust_checkpoint)
    agent, tokenizer = build_agent(str(info.step_dir) if info else spec.spec, scenario, tokenizer_path=args.tokenizer,
                                   agent_model=args.agent_model, api_key=key, concurrency=1, local=local)
    prompts = values["test_file"] or scenario_prompt_file(scenario, work / "prompt.parquet")
    dataset = RLHFDataset(prompts, tokenizer, max_prompt_length=values["max_prompt_length"])
    settings = EvalSettings(scenario=str(scenario_path), test_file=str(prompts), max_dialogues=1,
                            max_prompt_length=values["max_prompt_length"], max_turns=values["max_turns"],
                            max_tokens_per_turn=values["max_tokens_per_turn"],
                            max_response_length=values["max_response_length"],
                            max_user_tokens=values["max_user_tokens"], seed=values["seed"],
                            user_sim={"temperature": values["sim_temperature"], "top_p": values["sim_top_p"],
                                      "max_tokens": values["sim_max_tokens"], "timeout_s": values["sim_timeout_s"],
                                      "max_attempts": values["sim_max_attempts"], "model": args.sim_model})
    simulator = None
    if args.user_sim_urls:
        from llm_agent.user_sim.client import UserSimClient, parse_urls

        simulator = UserSimClient(parse_urls(args.user_sim_urls), model=args.sim_model, api_key=sim_key,
                                  timeout_s=values["sim_timeout_s"], max_attempts=values["sim_max_attempts"])
    sampler = StateController(ControllerConfig(seed=args.profile_seed), scenario)
    extra = {"agent": spec.describe(engine), "settings": settings.fingerprint()}

    def start_call(profile: Any) -> HumanCall:
        return HumanCall(agent, tokenizer, scenario, settings.loop_config(None), dataset.collate([0]), profile,
                         args.out, step=info.global_step if info else 0, extra=extra, seed=values["seed"],
                         simulator=simulator, stream=not args.no_stream)

    server = ChatServer(scenario, start_call, lambda: sampler.sample(1)[0], spec.name, host=args.host,
                        port=args.port)
    return server, [agent] + ([simulator] if simulator is not None else [])


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point; bad input exits with a one-line error."""
    args = parse_args(argv)
    for flag, env_var in (("--sim-api-key", SIM_KEY_ENV), ("--agent-api-key", AGENT_KEY_ENV)):
        if getattr(args, flag.removeprefix("--").replace("-", "_")) is not None:
            raise SystemExit(f"chat: {command_line_refusal(flag, env_var)}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="sead-chat-") as work:
        try:
            server, owned = build_server(args, Path(work))
        except (ValueError, OSError, RuntimeError) as exc:
            raise SystemExit(f"chat: {exc}") from None
        signal.signal(signal.SIGTERM, _interrupt)  # stop as on Ctrl-C: the call in progress abandoned, no record
        print(f"talk to the agent at {server.url}\ncalls go to {Path(args.out) / 'human_dialogues.jsonl'}",
              flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.shutdown()
            for thing in owned:
                thing.close()


if __name__ == "__main__":
    main()
