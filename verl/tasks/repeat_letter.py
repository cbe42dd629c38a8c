"""The built-in "repeat the letter" task: prompts, parquet generator and verifiable reward.

Each prompt asks the model to repeat one letter (e.g. ``Repeat the letter c: c c c c``); the parquet row keeps the
letter in the ``target`` column. The reward of a response looks at its first ``num_tokens`` loss-carrying tokens:
a token that decodes (whitespace stripped) to the target letter earns 1, any other single ASCII letter earns
``letter_credit``, anything else 0; the score is the mean over the ``num_tokens`` slots (missing tokens score 0)
and sits on the response's last loss-carrying token. It is a pure function of the sampled token ids, so it can be
checked by hand, and a random tiny model first learns to emit letters (reward ~0.5) and then the right one (~1).

    python -m verl.tasks.repeat_letter --out_dir outputs/data/repeat_letter [--train_size 512 --val_size 64]
"""
from __future__ import annotations

import argparse
import logging
import random
import string
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from verl.protocol import DataProto
from verl.trainer.ppo.plugins import BatchOutputs, declare_outputs

logger = logging.getLogger(__name__)

DATA_SOURCE = "repeat_letter"
DEFAULT_LETTERS = "abcde"
TEMPLATES = (
    "Repeat the letter {x}: {x} {x} {x} {x}",
    "Say {x} again and again: {x} {x} {x}",
    "Write only the letter {x}, {x}, {x}.",
    "Please repeat {x} {x} {x} {x}",
)

_VOCAB_CACHE: dict[tuple[int, int], torch.Tensor] = {}


def make_rows(size: int, seed: int, letters: str = DEFAULT_LETTERS, split: str = "train") -> list[dict[str, Any]]:
    """``size`` task rows (prompt messages, target letter, data_source, extra_info), deterministic in ``seed``."""
    if not letters or any(ch not in string.ascii_lowercase for ch in letters):
        raise ValueError(f"letters must be lowercase ASCII letters, got {letters!r}")
    rng = random.Random(seed)
    rows = []
    for i in range(size):
        letter = rng.choice(letters)
        text = rng.choice(TEMPLATES).format(x=letter)
        rows.append({
            "prompt": [{"role": "user", "content": text}],
            "target": letter,
            "data_source": DATA_SOURCE,
            "extra_info": {"index": i, "split": split},
        })
    return rows


def write_parquet(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Write task rows to a parquet file (creating its directory) and return its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def make_dataset(out_dir: str | Path, train_size: int = 512, val_size: int = 64, seed: int = 0,
                 letters: str = DEFAULT_LETTERS) -> tuple[Path, Path]:
    """Write ``train.parquet`` and ``val.parquet`` (disjoint seeds) under ``out_dir``; return both paths."""
    out = Path(out_dir)
    train = write_parquet(make_rows(train_size, seed, letters, "train"), out / "train.parquet")
    val = write_parquet(make_rows(val_size, seed + 1_000_003, letters, "val"), out / "val.parquet")
    return train, val


def _letter_table(tokenizer) -> torch.Tensor:
    """Per vocabulary id: the lowercase letter index 0..25 of a single-letter token (+26 if upper case), or -1."""
    key = (id(tokenizer), len(tokenizer))  # a tokenizer object's vocabulary does not change
    if key not in _VOCAB_CACHE:
        table = torch.full((len(tokenizer),), -1, dtype=torch.long)
        for token_id in range(len(tokenizer)):
            text = tokenizer.decode([token_id]).strip()
            if len(text) == 1 and text in string.ascii_letters:
                table[token_id] = string.ascii_letters.index(text)
        _VOCAB_CACHE[key] = table
    return _VOCAB_CACHE[key]


def score_responses(responses: torch.Tensor, response_mask: torch.Tensor, targets: list[str], tokenizer,
                    num_tokens: int = 4, letter_credit: float = 0.5) -> tuple[torch.Tensor, torch.Tensor,
                                                                              torch.Tensor]:
    """Per row: (score, target-letter fraction, any-letter fraction) over the first ``num_tokens`` loss tokens."""
    table = _letter_table(tokenizer)
    bs = responses.shape[0]
    target_idx = torch.tensor([string.ascii_letters.index(t) for t in targets], dtype=torch.long)
    letter_ids = torch.full((bs, num_tokens), -1, dtype=torch.long)
    mask = response_mask.bool()
    for row in range(bs):
        ids = responses[row][mask[row]][:num_tokens]
        known = (ids >= 0) & (ids < len(table))
        letter_ids[row, :ids.numel()] = torch.where(known, table[ids.clamp(0, len(table) - 1)], -1)
    is_target = (letter_ids == target_idx[:, None]).float()
    is_letter = (letter_ids >= 0).float()
    score = (is_target + letter_credit * (is_letter - is_target)).mean(dim=-1)
    return score, is_target.mean(dim=-1), is_letter.mean(dim=-1)


@declare_outputs(lambda kwargs: BatchOutputs())  # no optional batch entries (no per-turn rewards or labels)
def compute_reward(data: DataProto, tokenizer, num_tokens: int = 4, letter_credit: float = 0.5,
                   target_key: str = "target") -> tuple[torch.Tensor, dict[str, float]]:
    """Reward plug-in: (bs, R) float32 scores on each row's last loss-carrying token, plus task metrics."""
    if num_tokens <= 0:
        raise ValueError(f"reward.kwargs.num_tokens must be positive, got {num_tokens}")
    if not 0.0 <= letter_credit <= 1.0:
        raise ValueError(f"reward.kwargs.letter_credit must be in [0, 1], got {letter_credit}")
    if target_key not in data.non_tensor_batch:
        raise KeyError(f"repeat_letter reward needs non_tensor_batch[{target_key!r}] (the task's parquet column); "
                       f"got keys {sorted(data.non_tensor_batch)}")
    responses = data.batch["responses"]
    response_mask = data.batch["response_mask"]
    targets = [str(t) for t in data.non_tensor_batch[target_key]]
    score, target_frac, letter_frac = score_responses(responses, response_mask, targets, tokenizer, num_tokens,
                                                      letter_credit)
    reward = torch.zeros(responses.shape, dtype=torch.float32)
    positions = torch.arange(responses.shape[1]).expand_as(response_mask)
    last = torch.where(response_mask.bool(), positions, torch.full_like(positions, -1)).max(dim=-1).values
    last = last.clamp(min=0)
    reward[torch.arange(responses.shape[0]), last] = score
    metrics = {
        f"{DATA_SOURCE}/target_frac": float(target_frac.mean()),
        f"{DATA_SOURCE}/letter_frac": float(letter_frac.mean()),
        f"{DATA_SOURCE}/solved": float((target_frac == 1.0).float().mean()),
    }
    return reward, metrics


def main() -> None:
    """Command-line entry point: write the train/val parquet files."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", required=True, help="directory for train.parquet and val.parquet")
    parser.add_argument("--train_size", type=int, default=512, help="training prompts")
    parser.add_argument("--val_size", type=int, default=64, help="validation prompts")
    parser.add_argument("--seed", type=int, default=0, help="generator seed")
    parser.add_argument("--letters", default=DEFAULT_LETTERS, help="letters the prompts ask for")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    train, val = make_dataset(args.out_dir, args.train_size, args.val_size, args.seed, args.letters)
    logger.info("wrote %s and %s", train, val)


if __name__ == "__main__":
    main()
