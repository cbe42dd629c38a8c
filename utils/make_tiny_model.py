"""Build the tiny local model used by the tests and the CPU demo.

A byte-level BPE tokenizer is trained locally on a fixed corpus (`assets/tiny_tokenizer_corpus.json`, word
pieces and their counts, plus a built-in corpus drawn from the seed) and saved with a ChatML chat template; a
Qwen2-architecture causal LM with random weights (head_dim 32, the smallest size vLLM's CPU attention accepts) is
initialised from a seed. Both are written with `save_pretrained`, so `AutoTokenizer` /
`AutoModelForCausalLM.from_pretrained(dir)` load them. The scenarios' wording never reaches the vocabulary, so
editing a description, a prompt or a doubt line leaves the model's files byte-identical. With `tag_tokens`, every
scenario's agent tags (`<stage>`, `</stage>`, ...) become single tokens, so a tagged agent turn is about 40 tokens
instead of 90 (cheaper to train and generate on a CPU); `user_tag_tokens` does the same for the user simulator's
tags (a tiny simulator model): only a change of the tag protocol changes the vocabulary. The tags read are those of
`TOKENIZER_SCENARIO_PATHS` (the shipped scenarios, frozen: one shipped since, such as the support desk, is not
among them) plus those of the scenarios named with `--scenario` (a run's own): never the whole `format_prompt/`
folder, so a draft there, or a newly shipped scenario, changes no one's tokenizer. Nothing is downloaded.

    python -m utils.make_tiny_model --out outputs/tiny_model [--seed 0] [--vocab-size 1024] \
        [--hidden-size 64 --intermediate-size 128 --layers 2 --heads 2 --kv-heads 1 --tag-tokens] [--user-tag-tokens] \
        [--scenario F]
"""
from __future__ import annotations

import argparse
import json
import logging
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from llm_agent.scenario import TOKENIZER_SCENARIO_PATHS

logger = logging.getLogger(__name__)

CORPUS_PATH = Path(__file__).resolve().parents[1] / "assets" / "tiny_tokenizer_corpus.json"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_WORDS = (
    "hello thanks yes no maybe okay sure call phone app merchant restaurant manager owner trial credit free "
    "advertising platform button menu screen tap open claim message confirm step first second next done "
    "cost price charge money budget click customers orders week month year today tomorrow busy later "
    "who are you why how what when where please sorry understand help question answer trust believe "
    "refund order delivery account password device setting support ticket wait minute repeat again"
).split()
_TAGS = ("response", "stage", "status", "user_reply", "user_status", "cooperation", "emotion", "trust")


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model (and whether the scenarios' agent / user tags are whole tokens); the defaults are
    what the tests use."""

    vocab_size: int = 1024
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    max_position_embeddings: int = 4096
    tag_tokens: bool = False
    user_tag_tokens: bool = False


def builtin_corpus(seed: int, n_lines: int = 600) -> list[str]:
    """Return a deterministic corpus of varied short lines (words, digits, tags, chat markers)."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        tag = rng.choice(_TAGS)
        lines.append(f"<{tag}>{' '.join(words).capitalize()}, {rng.randint(0, 999)}.</{tag}>")
        lines.append(f"Step {i % 7}: {' '.join(reversed(words))}? {rng.choice('abcdefghij') * rng.randint(1, 4)}")
    return lines


def scenario_files(extra: Sequence[str | Path] = ()) -> list[Path]:
    """The tokenizer's scenario files (`TOKENIZER_SCENARIO_PATHS`) and `extra` ones (a run's own), each once, sorted
    by path."""
    return sorted({Path(p).resolve() for p in (*TOKENIZER_SCENARIO_PATHS, *extra)})


def fixed_corpus(path: Path = CORPUS_PATH) -> list[str]:
    """The shipped corpus as training text: each word piece repeated as often as it was counted, in file order."""
    pieces = json.loads(path.read_text(encoding="utf-8"))["pieces"]
    return [piece for piece, count in pieces.items() for _ in range(count)]


def scenario_tags(extra: Sequence[str | Path] = (), side: str = "agent") -> list[str]:
    """The opening and closing markup of every `side` ("agent" or "user") tag of `scenario_files(extra)`, sorted."""
    from llm_agent.scenario import load_scenario

    names = set()
    for path in scenario_files(extra):
        scenario = load_scenario(path)
        names.update((scenario.agent_tags if side == "agent" else scenario.user_tags).tags.values())
    return sorted(f"<{slash}{name}>" for name in names if name for slash in ("", "/"))


def build_tokenizer(corpus: list[str], vocab_size: int, whole_tokens: list[str] = ()):
    """Train a byte-level BPE tokenizer on `corpus` and wrap it as a transformers fast tokenizer; each string of
    `whole_tokens` is added as one (non-special) token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken(t, normalized=False, single_word=False) for t in whole_tokens])
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>", bos_token=None, unk_token=None
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def build_tiny_model(out_dir: str | Path, seed: int = 0, spec: TinyModelSpec = TinyModelSpec(),
                     scenarios: Sequence[str | Path] = ()) -> Path:
    """Write a tokenizer and a random-weight Qwen2 causal LM to `out_dir`, deterministically from `seed`; the
    tokenizer learns the fixed corpus, and the tags of the shipped scenarios and `scenarios` as whole tokens with
    `spec.tag_tokens` / `spec.user_tag_tokens`.

    Returns the directory. An existing build with the same seed, spec and corpus is reused as is.
    """
    import hashlib

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    corpus = fixed_corpus() + builtin_corpus(seed)
    tags = ((scenario_tags(scenarios) if spec.tag_tokens else [])
            + (scenario_tags(scenarios, "user") if spec.user_tag_tokens else []))
    fingerprint = hashlib.sha256(
        json.dumps({"seed": seed, "spec": asdict(spec), "corpus": corpus, "tags": tags}).encode()
    ).hexdigest()
    stamp = out / "tiny_model_fingerprint.txt"
    if stamp.exists() and stamp.read_text().strip() == fingerprint:
        return out

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(corpus, spec.vocab_size, tags)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    previous_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = Qwen2ForCausalLM(config)
    finally:
        torch.random.set_rng_state(previous_state)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    stamp.write_text(fingerprint + "\n")
    logger.info("tiny model (%d params, vocab %d) written to %s", model.num_parameters(), len(tokenizer), out)
    return out


def main() -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/tiny_model", help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="seed for the weights and the built-in corpus")
    parser.add_argument("--vocab-size", type=int, default=TinyModelSpec.vocab_size, help="BPE vocabulary size")
    parser.add_argument("--hidden-size", type=int, default=TinyModelSpec.hidden_size, help="model width")
    parser.add_argument("--intermediate-size", type=int, default=TinyModelSpec.intermediate_size,
                        help="MLP width")
    parser.add_argument("--layers", type=int, default=TinyModelSpec.num_hidden_layers, help="decoder layers")
    parser.add_argument("--heads", type=int, default=TinyModelSpec.num_attention_heads,
                        help="attention heads (keep hidden-size / heads >= 32 for vLLM on CPU)")
    parser.add_argument("--kv-heads", type=int, default=TinyModelSpec.num_key_value_heads, help="key/value heads")
    parser.add_argument("--tag-tokens", action="store_true", help="make every scenario agent tag one token")
    parser.add_argument("--user-tag-tokens", action="store_true", help="make every scenario user tag one token")
    parser.add_argument("--scenario", action="append", default=[],
                        help="a scenario file whose tags to learn besides the shipped ones' (repeatable)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    spec = TinyModelSpec(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                         intermediate_size=args.intermediate_size, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         tag_tokens=args.tag_tokens, user_tag_tokens=args.user_tag_tokens)
    if spec.hidden_size % spec.num_attention_heads or spec.num_attention_heads % spec.num_key_value_heads:
        parser.error("--hidden-size must be a multiple of --heads, and --heads a multiple of --kv-heads")
    path = build_tiny_model(args.out, seed=args.seed, spec=spec, scenarios=args.scenario)
    print(path)


if __name__ == "__main__":
    main()
