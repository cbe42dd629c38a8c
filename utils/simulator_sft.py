"""Fine-tune a user simulator (AReaL-SEA's recipe: supervised fine-tuning of the user model before RL).

    python -m utils.simulator_sft --model /models/Qwen2.5-7B-Instruct --out outputs/sim_sft \\
        --rollouts outputs/rollouts/<run>/rollouts.jsonl [--split train [val ...]] --steps 600 --lr 1e-5 ...
    torchrun --nproc_per_node 8 -m utils.simulator_sft ...            # FSDP2 over 8 GPUs (bf16, checkpointing)
    python -m utils.make_tiny_model --user-tag-tokens --out outputs/tiny_sim_base     # a small base to try it on
    python -m utils.simulator_sft --model outputs/tiny_sim_base --out outputs/sim_sft --scripted 400 --steps 300
    python -m utils.simulator_sft --tiny [full|quick] --out outputs/tiny_simulator    # the CI simulator (cached)
    python -m utils.simulator_sft --model outputs/tiny_simulator --out outputs/sim_refit --rollouts \\
        outputs/bench_learning/rollouts.jsonl --split val@scripted --scripted 500 --steps 300 --lr 1e-3 \\
        --reply-format canonical --max-length 2048 --number-weight 5   # refit on a judge's replies to the policy

Training examples are simulator requests and their replies: exactly the chat messages the rollout loop's client
sends (the persona, then the dialogue so far) followed by the simulator's tagged reply. They come from rollout logs
or evaluation dialogues (`--rollouts`: every simulator turn, re-rendered as the loop sent it; cached turns and
failed ones are left out) and/or from a dedicated run of scripted calls (`--scripted N`: scripted agents of
`--quality-mix` against the scenario's scripted persona, its replies as written, think tag included). An example
that cannot fit `--max-length` tokens is dropped first, by its length in characters, before it is checked, rendered
or tokenised (`too_long`; ingestion is linear in the logs' size: BENCHMARKS.md). Only replies that pass the
simulator report card's checks are kept (exact tag protocol, no control-token text such as `<|im_start|>`, state
jumps within the scenario's limits, no state moving against the agent's turn: llm_agent/simulator_report/checks.py);
the counts of what was dropped and why go to `simulator_sft.json`. Message text becomes tokens by the one rule for
outside text (`verl.utils.text_tokens`: special tokens split). The loss is on the reply tokens only
(`--number-weight` weighs the reply's number tokens, the states and the status, above its words). When a reply is
exactly what the next request shows as the simulator's earlier turn (logged replies are; `--reply-format canonical`
makes scripted ones so), a dialogue's examples share one sequence with the loss on each kept reply, which is the
same objective at a fraction of the tokens.

The model is trained by `verl.trainer.fsdp_sft_trainer.train_sft` (one process, or FSDP2 over the ranks of a
torchrun launch) and exported as a Hugging Face model directory with its tokenizer, which
`scripts/start_user_sims.sh --model DIR` serves with vLLM (or `--backend hf`) and `scripts/main.sh` uses with
`USER_SIM_MODEL=DIR`. `--tiny` builds the CI's simulator: a tiny Qwen2 model (utils/make_tiny_model.py, the
scenario tags as whole tokens; kept in `DIR/base/`) trained on scripted calls with a fixed recipe, reused while the
recipe, the scenario files and the code that makes it are unchanged (a fingerprint in `simulator_sft.json`).
Two recipes: `full` (TinyRecipe, graded in BENCHMARKS.md) and `quick` (QUICK_RECIPE, the `vllm` test's: 64 calls
and 100 steps, minutes to make).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import re
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from llm_agent.evaluation.run_data import read_dialogues
from llm_agent.scenario import DEFAULT_SCENARIO_PATH, Scenario, load_scenario
from llm_agent.simulator_report import ReplyChecker, ScriptedReference, dialogues_from_log
from llm_agent.stand_ins.scripted_calls import scripted_calls
from utils.make_tiny_model import TinyModelSpec, build_tiny_model
from utils.sft_warm_start import encode_dialogue, parse_quality_mix
from verl.trainer.fsdp_sft_trainer import SFTConfig, SFTRow, train_sft
from verl.utils.text_tokens import control_texts, may_fit

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
INFO_FILE = "simulator_sft.json"
REPLY_FORMATS = ("raw", "canonical")
_NUMBER_TOKEN = re.compile(r"-?\d+|-")


@dataclass(frozen=True)
class SimulatorExample:
    """One simulator request (chat messages) and the reply to learn; `group` names its dialogue."""

    group: str
    messages: list[dict[str, str]]
    reply: str


def scripted_examples(scenario: Scenario, n: int, quality_mix: Mapping[str, float], seed: int,
                      max_turns: int = 10) -> list[SimulatorExample]:
    """Every simulator request of `n` scripted calls (`llm_agent.stand_ins.scripted_calls`) with the scripted
    persona's reply as written."""
    return [SimulatorExample(f"scripted-{k}", exchange.messages, exchange.reply)
            for k, call in enumerate(scripted_calls(scenario, n, quality_mix, seed, max_turns=max_turns))
            for exchange in call.exchanges]


def logged_examples(paths: Iterable[str | Path], scenario: Scenario, splits: Collection[str] | None = None
                    ) -> list[SimulatorExample]:
    """Every answered simulator turn of rollout logs / evaluation dialogues files (of one of `splits`, when given),
    with the reply the loop accepted, re-written canonically as the log keeps it."""
    examples = []
    for path in paths:
        records = [r for r in read_dialogues(path) if splits is None or r.split in splits]
        for i, dialogue in enumerate(dialogues_from_log(records, scenario)):
            group = f"{path}#{i}"
            examples += [SimulatorExample(group, t.messages, t.replies[-1]) for t in dialogue.turns if t.replies]
    return examples


def canonical(scenario: Scenario, reply: str) -> str:
    """The reply as later requests show it: reply, state and status tags only (no think)."""
    user = scenario.parse_user_output(reply)
    return scenario.format_user_output(user.reply or "", user.state, user.status)


def filter_examples(examples: Sequence[SimulatorExample], scenario: Scenario, max_jump: int | None = None,
                    control_texts: Collection[str] = ()) -> tuple[list[SimulatorExample], Counter]:
    """The examples whose reply passes the report card's checks (`control_texts`: the tokenizer's special tokens,
    which no reply may hold), and the count of each reason for dropping one (`control_text`, `not_format_valid`,
    `jump_over_limit`, `against_agent_turn`)."""
    reference, checker = ScriptedReference(scenario), ReplyChecker(scenario, max_jump, control_texts)
    kept, dropped = [], Counter()
    for example in examples:
        check = checker.check(example.reply, reference.react(example.messages))
        if check.passes:
            kept.append(example)
            continue
        reason = ("control_text" if check.control_text else "not_format_valid" if not check.format_valid
                  else "jump_over_limit" if not check.jump_ok else "against_agent_turn")
        dropped[reason] += 1
    return kept, dropped


def within_length(tokenizer, examples: Sequence[SimulatorExample], max_length: int
                  ) -> tuple[list[SimulatorExample], int]:
    """The examples whose request and reply may fit `max_length` tokens, and how many certainly do not (counted by
    characters, `verl.utils.text_tokens.may_fit`: nothing is parsed, rendered or tokenised for those)."""
    fitting = [e for e in examples if may_fit(tokenizer, [*(m["content"] for m in e.messages), e.reply], max_length)]
    return fitting, len(examples) - len(fitting)


def _chains(examples: Sequence[SimulatorExample]) -> list[tuple[list[dict[str, str]], list[int]]]:
    """(messages, indices of the replies to learn) per training sequence: consecutive examples of one group
    share a sequence while each request extends the previous one with its reply (see the module docstring)."""
    chains: list[tuple[list[dict[str, str]], list[int]]] = []
    last_group = None
    for example in examples:
        target = {"role": "assistant", "content": example.reply}
        if chains and example.group == last_group:
            messages, marked = chains[-1]
            if example.messages[:len(messages)] == messages:
                chains[-1] = (example.messages + [target], marked + [len(example.messages)])
                continue
        chains.append((example.messages + [target], [len(example.messages)]))
        last_group = example.group
    return chains


def weigh_numbers(tokenizer, rows: Sequence[SFTRow], weight: float) -> list[SFTRow]:
    """`rows` with the loss weight of every loss-carrying number token (one that decodes to an integer or a minus
    sign: the state and status values of a reply) multiplied by `weight`."""
    if weight == 1:
        return list(rows)
    if weight <= 0:
        raise ValueError(f"number_weight must be > 0, got {weight}")
    numbers = {i for i in {t for r in rows for t, m in zip(r.input_ids, r.loss_mask) if m}
               if _NUMBER_TOKEN.fullmatch(tokenizer.decode([i]).strip())}
    return [SFTRow(r.input_ids, [m * weight if m and t in numbers else m for t, m in zip(r.input_ids, r.loss_mask)])
            for r in rows]


def encode_examples(tokenizer, examples: Sequence[SimulatorExample], max_length: int
                    ) -> tuple[list[SFTRow], int]:
    """Training rows of `examples` (shared sequences where possible) and how many examples were dropped because
    even alone they exceed `max_length` tokens (a request cut at its end would lose its reply). No sequence is
    rendered or tokenised past the budget (`encode_dialogue(overflow="drop")`), so the cost is linear in the
    examples whatever their length."""
    rows, too_long = [], 0
    for messages, marked in _chains(examples):
        row = encode_dialogue(tokenizer, messages, max_length, loss_on=marked, overflow="drop")
        if row is not None:
            rows.append(row)
            continue
        for index in marked:  # the shared sequence is too long: its examples one by one
            alone = encode_dialogue(tokenizer, messages[:index + 1], max_length, loss_on="last", overflow="drop")
            if alone is not None:
                rows.append(alone)
            else:
                too_long += 1
    return rows, too_long


@dataclass(frozen=True)
class TinyRecipe:
    """The CI simulator: a tiny model (its spec) fine-tuned on scripted calls with these settings."""

    spec: TinyModelSpec = TinyModelSpec(vocab_size=2048, hidden_size=128, intermediate_size=256,
                                        num_hidden_layers=2, num_attention_heads=4, tag_tokens=True,
                                        user_tag_tokens=True)
    n_calls: int = 2500
    # wrong_answer: doubts answered with another category's answer, which the persona does not take for an answer
    quality_mix: dict[str, float] = field(default_factory=lambda: {"good": 0.4, "evasive": 0.2, "wrong_answer": 0.2,
                                                                   "bad": 0.2})
    reply_format: str = "canonical"
    max_turns: int = 10
    max_length: int = 2048
    sft: SFTConfig = SFTConfig(steps=1000, lr=3e-3, batch_size=8, seed=0, warmup_steps=20, lr_schedule="cosine",
                               min_lr_ratio=0.1)
    number_weight: float = 5.0
    seed: int = 0


# The `vllm` test's simulator: 64 calls and 100 steps of 4 (minutes on a loaded 2-core box). It follows
# the tag protocol on most turns, not all: the loop's re-requests run, and the card's figures are TinyRecipe's.
QUICK_RECIPE = TinyRecipe(n_calls=64, sft=SFTConfig(steps=100, lr=3e-3, batch_size=4, seed=0, warmup_steps=10,
                                                    lr_schedule="cosine", min_lr_ratio=0.1))
RECIPES = {"full": TinyRecipe(), "quick": QUICK_RECIPE}


# The code whose behaviour decides what the tiny simulator is: a change in any of it makes the simulator again.
_PRODUCERS = ("utils/simulator_sft.py", "utils/make_tiny_model.py", "utils/sft_warm_start.py",
              "verl/trainer/fsdp_sft_trainer.py", "llm_agent/stand_ins/scripted_calls.py",
              "llm_agent/stand_ins/scripted_policy.py", "llm_agent/user_sim/server/scripted.py",
              "llm_agent/simulator_report/checks.py", "llm_agent/simulator_report/reference.py")


def tiny_fingerprint(recipe: TinyRecipe, scenario_path: str | Path) -> str:
    """sha256 of what makes the tiny simulator: the recipe, the scenario and behaviour library files, the code."""
    scenario = load_scenario(scenario_path)
    digest = hashlib.sha256(json.dumps(asdict(recipe), sort_keys=True, default=str).encode())
    for path in [Path(scenario.path), *(REPO_ROOT / p for p in _PRODUCERS)]:
        digest.update(path.read_bytes())
    digest.update(json.dumps([b.to_dict() for b in scenario.behaviors]).encode())
    return digest.hexdigest()


def training_rows(tokenizer, examples: Sequence[SimulatorExample], scenario: Scenario, max_length: int,
                  reply_format: str = "raw", max_jump: int | None = None, number_weight: float = 1.0
                  ) -> tuple[list[SFTRow], dict[str, object]]:
    """The training rows of `examples` (too long ones dropped first, then the checks' filter, then encoding; see
    the module docstring) and the counts of what was kept and dropped; ValueError when no row is left."""
    if reply_format not in REPLY_FORMATS:
        raise ValueError(f"reply_format must be one of {REPLY_FORMATS}, got {reply_format!r}")
    fitting, too_long = within_length(tokenizer, examples, max_length)  # before anything else reads them
    kept, dropped = filter_examples(fitting, scenario, max_jump, control_texts(tokenizer))
    if reply_format == "canonical":
        kept = [SimulatorExample(e.group, e.messages, canonical(scenario, e.reply)) for e in kept]
    rows, too_long_encoded = encode_examples(tokenizer, kept, max_length)
    too_long += too_long_encoded
    rows = weigh_numbers(tokenizer, rows, number_weight)
    if not rows:
        raise ValueError(f"no training example left: {len(examples)} examples, dropped {dict(dropped)}, "
                         f"{too_long} longer than max_length={max_length}")
    return rows, {"examples": len(examples), "kept": len(kept) - too_long_encoded, "dropped": dict(dropped),
                  "too_long": too_long, "rows": len(rows), "tokens": sum(len(r.input_ids) for r in rows),
                  "reply_tokens": sum(sum(1 for m in r.loss_mask if m) for r in rows)}


def fine_tune(model: str | Path, out: str | Path, examples: Sequence[SimulatorExample], scenario: Scenario,
              config: SFTConfig, max_length: int, reply_format: str = "raw", max_jump: int | None = None,
              number_weight: float = 1.0, info: Mapping[str, object] | None = None) -> Path:
    """Fine-tune `model` into `out` on the :func:`training_rows` of `examples` (loss on the replies, number tokens
    weighted by `number_weight`); `simulator_sft.json` in `out` records the counts and `info`."""
    from transformers import AutoTokenizer

    rows, counts = training_rows(AutoTokenizer.from_pretrained(model), examples, scenario, max_length, reply_format,
                                 max_jump, number_weight)
    logger.info("simulator sft: %s", counts)
    path = train_sft(model, rows, out, config, extra_log={"simulator_examples": counts})
    if int(os.environ.get("RANK", "0")) == 0:
        record = {"scenario": str(scenario.path), "reply_format": reply_format, "max_length": max_length,
                  "number_weight": number_weight, **counts, **dict(info or {})}
        (Path(path) / INFO_FILE).write_text(json.dumps(record, indent=1, default=str) + "\n", encoding="utf-8")
    return path


@contextlib.contextmanager
def _all_cores() -> Iterator[None]:
    """torch uses every core inside the block (the tiny simulator is made once, alone), then what it had before."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tiny_simulator(out: str | Path, scenario_path: str | Path = DEFAULT_SCENARIO_PATH,
                   recipe: TinyRecipe = TinyRecipe()) -> Path:
    """The CI simulator at `out` (its untrained base model in `out/base`): made with `recipe` unless `out` already
    holds one with the same fingerprint."""
    out = Path(out)
    fingerprint = tiny_fingerprint(recipe, scenario_path)
    info = out / INFO_FILE
    if info.exists() and json.loads(info.read_text(encoding="utf-8")).get("fingerprint") == fingerprint:
        logger.info("tiny simulator: reusing %s", out)
        return out
    scenario = load_scenario(scenario_path)
    base = build_tiny_model(out / "base", seed=recipe.seed, spec=recipe.spec)
    examples = scripted_examples(scenario, recipe.n_calls, recipe.quality_mix, recipe.seed, recipe.max_turns)
    with _all_cores():
        return fine_tune(base, out, examples, scenario, recipe.sft, recipe.max_length, recipe.reply_format,
                         number_weight=recipe.number_weight,
                         info={"fingerprint": fingerprint, "recipe": asdict(recipe), "base": "base"})


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", required=True, help="the exported model directory")
    p.add_argument("--tiny", choices=sorted(RECIPES), nargs="?", const="full", default=None,
                   help="make (or reuse) the CI's tiny simulator with this recipe (full: TinyRecipe, the "
                        "benchmark's; quick: the vllm test's); other training options do not apply")
    p.add_argument("--model", help="the base model directory (local)")
    p.add_argument("--scenario", default=str(DEFAULT_SCENARIO_PATH), help="scenario YAML")
    p.add_argument("--rollouts", nargs="+", default=[], help="rollout logs / evaluation dialogues files")
    p.add_argument("--split", nargs="+", default=None,
                   help="only logged dialogues of these splits (e.g. train; val@scripted: a judge's validations)")
    p.add_argument("--scripted", type=int, default=0, help="scripted calls to add as examples")
    p.add_argument("--quality-mix", default=",".join(f"{k}={v}" for k, v in TinyRecipe().quality_mix.items()),
                   help="scripted agent qualities and their weights")
    p.add_argument("--max-turns", type=int, default=10, help="agent turns per scripted call")
    p.add_argument("--reply-format", choices=REPLY_FORMATS, default="raw",
                   help="scripted replies as written (raw, think tag included) or as later requests show them")
    p.add_argument("--max-jump", type=int, default=None, help="the checks' largest allowed state change per turn")
    p.add_argument("--number-weight", type=float, default=1.0,
                   help="loss weight of the reply's number tokens (states, status) relative to its other tokens")
    p.add_argument("--max-length", type=int, default=8192, help="tokens per training sequence")
    defaults = SFTConfig(steps=1, lr=1.0)
    p.add_argument("--steps", type=int, default=None, help="optimizer steps")
    p.add_argument("--lr", type=float, default=1e-5, help="peak learning rate")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, help="sequences per step, all ranks")
    p.add_argument("--micro-batch-size", type=int, default=None, help="sequences per forward on one rank")
    p.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up steps")
    p.add_argument("--lr-schedule", choices=("constant", "cosine"), default="cosine", help="after the warm-up")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="the cosine schedule's floor")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations (large models)")
    p.add_argument("--param-dtype", choices=("auto", "fp32", "bf16"), default="auto", help="compute dtype")
    p.add_argument("--export-dtype", choices=("fp32", "bf16"), default="fp32", help="dtype of the saved weights")
    p.add_argument("--seed", type=int, default=0, help="seed of the data order and the scripted calls")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if int(os.environ.get("RANK", "0")) == 0 else logging.WARNING,
                        format="%(message)s")
    try:
        if args.tiny:
            path = tiny_simulator(args.out, args.scenario, RECIPES[args.tiny])
        else:
            if not args.model or args.steps is None or not (args.rollouts or args.scripted):
                raise ValueError("give --model, --steps and --rollouts and/or --scripted N (or --tiny)")
            scenario = load_scenario(args.scenario)
            examples = logged_examples(args.rollouts, scenario, args.split)
            if args.scripted:
                examples += scripted_examples(scenario, args.scripted, parse_quality_mix(args.quality_mix),
                                              args.seed, args.max_turns)
            config = SFTConfig(steps=args.steps, lr=args.lr, batch_size=args.batch_size,
                               micro_batch_size=args.micro_batch_size, seed=args.seed,
                               warmup_steps=args.warmup_steps, lr_schedule=args.lr_schedule,
                               min_lr_ratio=args.min_lr_ratio, gradient_checkpointing=args.gradient_checkpointing,
                               param_dtype=args.param_dtype, export_dtype=args.export_dtype)
            path = fine_tune(args.model, args.out, examples, scenario, config, args.max_length, args.reply_format,
                             args.max_jump, args.number_weight, info={"base": args.model, "rollouts": args.rollouts,
                                                  "split": args.split, "scripted_calls": args.scripted})
    except (OSError, ValueError) as exc:
        raise SystemExit(f"simulator_sft: {exc}") from None
    if int(os.environ.get("RANK", "0")) == 0:
        print(path)


if __name__ == "__main__":
    main()
