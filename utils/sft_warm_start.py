"""Supervised warm start of a local causal LM on agent-side chat transcripts (plain torch, no Ray).

A random-weight model never writes a well-formed agent turn, so RL gets no signal from it. `sft_on_dialogues`
fine-tunes it on transcripts (lists of {"role", "content"} messages rendered with the tokenizer's own chat
template) with the loss on the assistant tokens only; `scripted_dialogues` plays scripted agents of mixed
quality against the scripted simulator (in-process) to produce such transcripts from the agent's side.

    python -m utils.sft_warm_start --model outputs/tiny_model --out outputs/tiny_sft \\
        --dialogues dialogues.jsonl --steps 150 [--lr 1e-2 --batch-size 8 --seed 0 --max-length 1024]
    python -m utils.sft_warm_start --model outputs/tiny_model --out outputs/tiny_sft --steps 150 \\
        --scenario verl/trainer/config/format_prompt/inbound_support.yaml [--n-dialogues 64 \\
        --quality-mix good=0.4,bad=0.1,malformed=0.5 --max-turns 3 --system-prompt "..."]

`dialogues.jsonl` holds one transcript per line: a JSON list of messages, or an object with a "messages" list.
A warm start whose greedy calls rarely complete but whose samples sometimes do (what GRPO with the
completion-only reward needs): bench/learning.py (1,024 calls, an "evasive"/"good" quality mix of 0.65/0.35, on a
tag-token model).
"""
from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

from llm_agent.stand_ins.scripted_calls import AgentFactory, scripted_calls
from verl.trainer.fsdp_sft_trainer import SFTConfig, SFTRow, train_sft
from verl.utils.text_tokens import max_token_chars, may_fit, tokenize_chat

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
LOSS_ON = ("all", "last")
OVERFLOWS = ("cut", "drop")


def check_messages(messages: object, where: str) -> list[dict[str, str]]:
    """Validate a transcript; ValueError names `where` and the message index of the first problem."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: a transcript must be a non-empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or set(m) != {"role", "content"}:
            raise ValueError(f"{where}: message {i} must be an object with exactly the keys 'role' and 'content'")
        if m["role"] not in ROLES or not isinstance(m["content"], str):
            raise ValueError(f"{where}: message {i} needs a role in {ROLES} and a string content, got {dict(m)!r}")
    if messages[0]["role"] == "assistant":
        raise ValueError(f"{where}: message 0 is an assistant turn; a transcript starts with a system or user one")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: the transcript has no assistant message, so there is nothing to learn")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _render(tokenizer, messages: Sequence[Mapping[str, str]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)


def _extend(rendered: str, covered: str, what: str) -> str:
    """The text `rendered` adds after `covered`; the template must render each prefix as a prefix."""
    if not rendered.startswith(covered):
        raise ValueError(f"the chat template does not render {what} as an extension of the messages before it, "
                         "so the assistant tokens cannot be located by incremental rendering")
    return rendered[len(covered):]


def _assistant_span(body: str, content: str, eos: str | None, index: int) -> tuple[int, int]:
    """Where the sampled part of an assistant message lies in its rendering: the content, plus an EOS marker
    that the template writes right after it (the policy samples that token to end its turn)."""
    start = body.find(content) if content else len(body) - len(body.lstrip())
    if start < 0:
        raise ValueError(f"message {index}: the chat template changes the assistant content, so it cannot be "
                         "found in the rendering")
    end = start + len(content)
    if eos:
        after = body.find(eos, end)
        if after >= 0 and not body[end:after].strip():
            end = after + len(eos)
    return start, end


def encode_dialogue(tokenizer, messages: Sequence[Mapping[str, str]], max_length: int | None = None,
                    loss_on: str | Collection[int] = "all", overflow: str = "cut") -> SFTRow | None:
    """Render `messages` with the tokenizer's chat template and mark the assistant tokens that carry loss: every
    assistant message (`loss_on="all"`), only the last message, which must be an assistant one (`"last"`: a
    prompt and its answer, e.g. one simulator request and the simulator's reply), or the assistant messages at
    the given indices.

    The template is rendered incrementally: the text before each marked assistant message (with the generation
    prompt, as the model sees it when it starts its turn) and the text including it. The marked span is the
    content plus the EOS marker the template writes right after it; role markers and everything else get mask
    0. Each piece is tokenised on its own, as the rollout loop appends tokens, so the mask never straddles a
    token (with `"last"` the whole prompt is one piece, tokenised as a server tokenises it); message text is
    tokenised by the one rule for outside text (`verl.utils.text_tokens`: control-token text in a message is
    never a control token). A sequence longer than `max_length` tokens is cut at the end (`overflow="cut"`) or
    not encoded at all (`"drop"`: None); either way no more of it is rendered or tokenised than the budget needs.
    """
    if overflow not in OVERFLOWS:
        raise ValueError(f"overflow must be one of {OVERFLOWS}, got {overflow!r}")
    messages = check_messages(list(messages), "transcript")
    if isinstance(loss_on, str):
        if loss_on not in LOSS_ON:
            raise ValueError(f"loss_on must be one of {LOSS_ON} or message indices, got {loss_on!r}")
        marked = [len(messages) - 1] if loss_on == "last" else [i for i, m in enumerate(messages)
                                                                if m["role"] == "assistant"]
    else:
        marked = sorted(set(loss_on))
    bad = [i for i in marked if not 0 <= i < len(messages) or messages[i]["role"] != "assistant"]
    if bad:
        raise ValueError(f"transcript: loss_on={loss_on!r} marks message(s) {bad}, which are not assistant messages")
    if max_length is not None and overflow == "drop" and not may_fit(tokenizer, (m["content"] for m in messages),
                                                                      max_length):
        return None
    enough = None if max_length is None else (max_length + 1) * max_token_chars(tokenizer)  # chars past the cut
    eos = tokenizer.eos_token
    pieces: list[tuple[str, int]] = []
    covered = ""
    for i in marked:
        if enough is not None and len(covered) > enough:
            break
        head = _render(tokenizer, messages[:i], generation_prompt=True)
        pieces.append((_extend(head, covered, f"the messages before message {i}"), 0))
        body = _extend(_render(tokenizer, messages[: i + 1], generation_prompt=False), head,
                       f"assistant message {i} after the generation prompt")
        start, end = _assistant_span(body, messages[i]["content"], eos, i)
        pieces += [(body[:start], 0), (body[start:end], 1), (body[end:], 0)]
        covered = head + body
    if enough is None or len(covered) <= enough:
        pieces.append((_extend(_render(tokenizer, messages, generation_prompt=False), covered, "the last messages"), 0))
    merged: list[tuple[str, int]] = []
    for text, flag in pieces:
        if merged and merged[-1][1] == flag:
            merged[-1] = (merged[-1][0] + text, flag)
        elif text:
            merged.append((text, flag))
    encoded = tokenize_chat(tokenizer, messages, merged, max_tokens=max_length, cut=overflow == "cut")
    return None if encoded is None else SFTRow(*encoded)


def sft_on_dialogues(model_path: str | Path, out_dir: str | Path, dialogues: list[list[dict]], steps: int,
                     lr: float, batch_size: int = 8, seed: int = 0, max_length: int = 1024,
                     lr_schedule: str = "constant", micro_batch_size: int | None = None,
                     reshard_after_forward: bool = True) -> Path:
    """Fine-tune the local causal LM at `model_path` on `dialogues`, loss on assistant tokens only.

    `verl.trainer.fsdp_sft_trainer.train_sft` with AdamW at `lr`, constant or decayed by `lr_schedule`
    ("cosine": to 0 at the last step; gradient norm clipped to 1), `steps`
    updates of `batch_size` transcripts drawn epoch by epoch in a seeded shuffled order; the loss is the mean over
    all assistant tokens of the batch. Model and tokenizer are written to `out_dir` with save_pretrained, plus
    `sft_log.json` (per-step loss, settings, wall time). Returns `out_dir`.
    """
    from transformers import AutoTokenizer

    if steps < 1 or batch_size < 1 or lr <= 0 or max_length < 2:
        raise ValueError(f"need steps >= 1, batch_size >= 1, lr > 0 and max_length >= 2; got steps={steps}, "
                         f"batch_size={batch_size}, lr={lr}, max_length={max_length}")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    encoded = []
    for i, messages in enumerate(dialogues):
        row = encode_dialogue(tokenizer, check_messages(messages, f"dialogue {i}"), max_length)
        if sum(row.loss_mask) == 0:
            logger.warning("dialogue %d has no assistant token within max_length=%d; skipped", i, max_length)
            continue
        encoded.append(row)
    if not encoded:
        raise ValueError(f"no dialogue keeps an assistant token within max_length={max_length}")
    config = SFTConfig(steps=steps, lr=lr, batch_size=batch_size, seed=seed, lr_schedule=lr_schedule,
                       micro_batch_size=micro_batch_size, reshard_after_forward=reshard_after_forward)
    return train_sft(model_path, encoded, out_dir, config,
                     extra_log={"max_length": max_length, "n_dialogues": len(encoded)})


def scripted_dialogues(scenario_path: str | Path, n: int, quality_mix: Mapping[str, float], seed: int,
                       agent_factory: AgentFactory | None = None, max_turns: int = 10,
                       system_prompt: str | None = None) -> list[list[dict]]:
    """Play `n` scripted calls from the agent's side and return their transcripts.

    The calls are `llm_agent.stand_ins.scripted_calls.scripted_calls(...)`: each draws an agent quality from
    `quality_mix` (name -> weight) and a user profile (uniform initial state, 1-3 library behaviours), then
    alternates the agent (`agent_factory(quality, seed)`: a callable from the agent-side messages so far to its raw
    output; default `scripted_policy_agents`) with the scripted simulator in process. A transcript is
    `Scenario.render_agent_messages` of the call: system prompt, opening, the agent's raw turns and the user's
    spoken replies, exactly what the policy sees in the rollout loop. `system_prompt` replaces the scenario's
    agent system prompt in the transcripts (e.g. a compact one for a tiny model, matching the prompts it is then
    trained on with RL); the agents never read it.
    """
    from llm_agent.scenario import load_scenario

    scenario = load_scenario(scenario_path)
    transcripts, outcomes = [], {}
    for call in scripted_calls(scenario, n, quality_mix, seed, agent_factory, max_turns):
        key = f"{call.quality}/{call.outcome}"
        outcomes[key] = outcomes.get(key, 0) + 1
        messages = scenario.render_agent_messages(call.dialogue)
        if system_prompt is not None:
            messages[0] = {"role": "system", "content": system_prompt}
        transcripts.append(messages)
    logger.info("scripted dialogues: %s", dict(sorted(outcomes.items())))
    return transcripts


def read_dialogues(path: str | Path) -> list[list[dict]]:
    """Transcripts from a JSONL file (a message list, or an object with "messages", per line).

    ValueError names the file and line of a bad entry.
    """
    dialogues = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            messages = item.get("messages") if isinstance(item, dict) else item
            dialogues.append(check_messages(messages, f"{path}:{lineno}"))
    if not dialogues:
        raise ValueError(f"{path}: no transcripts")
    return dialogues


def parse_quality_mix(text: str) -> dict[str, float]:
    """Parse "good=0.4,bad=0.1,malformed=0.5" into a quality -> weight mapping (ValueError names the bad part)."""
    mix = {}
    for part in text.split(","):
        name, sep, weight = part.partition("=")
        try:
            mix[name.strip()] = float(weight)
        except ValueError:
            sep = ""
        if not sep or not name.strip():
            raise ValueError(f"--quality-mix: {part!r} is not name=weight")
    return mix


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point: SFT on a JSONL file of transcripts or on freshly played scripted calls."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="directory of the local model and tokenizer")
    parser.add_argument("--out", required=True, help="output directory")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--dialogues", help="JSONL file of transcripts")
    source.add_argument("--scenario", help="scenario YAML: play scripted calls instead (see scripted_dialogues)")
    parser.add_argument("--n-dialogues", type=int, default=64, help="scripted calls to play (with --scenario)")
    parser.add_argument("--quality-mix", default="good=0.4,bad=0.1,malformed=0.5",
                        help="scripted agent qualities and their weights (with --scenario)")
    parser.add_argument("--max-turns", type=int, default=10, help="agent turns per scripted call (with --scenario)")
    parser.add_argument("--system-prompt", default=None,
                        help="replace the scenario's agent system prompt in the transcripts (with --scenario)")
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
    parser.add_argument("--batch-size", type=int, default=8, help="transcripts per step")
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="transcripts per forward on one rank (default: the rank's whole share of a step)")
    parser.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                        help="the learning rate: constant, or decayed to 0 at the last step")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data order and of the scripted calls")
    parser.add_argument("--max-length", type=int, default=1024, help="tokens kept per transcript")
    parser.add_argument("--keep-gathered-weights", action="store_true",
                        help="under torchrun, keep each layer's gathered weights from its forward to its backward "
                             "(the same result with fewer all-gathers; every rank holds the whole model)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.dialogues is not None:
            dialogues = read_dialogues(args.dialogues)
        else:
            dialogues = scripted_dialogues(args.scenario, args.n_dialogues, parse_quality_mix(args.quality_mix),
                                           seed=args.seed, max_turns=args.max_turns,
                                           system_prompt=args.system_prompt)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    path = sft_on_dialogues(args.model, args.out, dialogues, steps=args.steps, lr=args.lr,
                            batch_size=args.batch_size, seed=args.seed, max_length=args.max_length,
                            lr_schedule=args.lr_schedule, micro_batch_size=args.micro_batch_size,
                            reshard_after_forward=not args.keep_gathered_weights)
    print(path)


if __name__ == "__main__":
    main()
