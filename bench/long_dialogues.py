"""The long-dialogue batch of ``bench/train_step.py --long-dialogues``: call lengths from a skewed distribution.

A SEAD call is an agent prompt (system prompt + scenario, left-padded to ``prompt_width``) followed by the
conversation: agent turns (loss tokens) alternating with user-simulator turns (``response_mask`` 0). Total
lengths (prompt + conversation) follow a log-normal distribution clipped to [``min_len``, ``max_len``]: most
calls end after a few turns (hang-ups, quick rejections), a long tail runs many turns. The padded layout is as
wide as the longest possible call, as the rollout produces it (``data.max_prompt_length`` +
``data.max_response_length``).
"""
from __future__ import annotations

import math

import torch

from verl.protocol import DataProto


def sample_call_lengths(
    rows: int, min_len: int, max_len: int, median: float, sigma: float, gen: torch.Generator
) -> torch.Tensor:
    """Total call lengths: log-normal with the given median and sigma, clipped to [min_len, max_len]."""
    normal = torch.randn(rows, generator=gen, dtype=torch.float64)
    return torch.exp(math.log(median) + sigma * normal).round().clamp(min_len, max_len).long()


def make_long_dialogue_batch(
    rows: int, vocab: int, prompt_width: int = 256, max_len: int = 4096, min_len: int = 256,
    median: float = 900.0, sigma: float = 0.7, seed: int = 0,
) -> DataProto:  # fmt: skip
    """An update batch of ``rows`` calls (keys of ``update_actor`` except ``old_log_probs``) and their lengths.

    Prompts have 128..``prompt_width`` tokens; agent turns 20-60 tokens, user turns 10-40 tokens.
    """
    gen = torch.Generator().manual_seed(seed)
    response_width = max_len - prompt_width
    totals = sample_call_lengths(rows, min_len, max_len, median, sigma, gen)
    prompt_lens = torch.randint(128, prompt_width + 1, (rows,), generator=gen).minimum(totals - 16)
    attention_mask = torch.zeros(rows, max_len, dtype=torch.long)
    response_mask = torch.zeros(rows, response_width, dtype=torch.long)
    for row in range(rows):
        attention_mask[row, prompt_width - prompt_lens[row] : prompt_width + totals[row] - prompt_lens[row]] = 1
        position, agent = 0, True
        conversation = int(totals[row] - prompt_lens[row])
        while position < conversation:
            turn = int(torch.randint(20, 61, (1,), generator=gen)) if agent else int(
                torch.randint(10, 41, (1,), generator=gen))
            response_mask[row, position : min(position + turn, conversation)] = int(agent)
            position, agent = position + turn, not agent
    input_ids = torch.randint(4, vocab, (rows, max_len), generator=gen)
    input_ids = torch.where(attention_mask.bool(), input_ids, torch.full_like(input_ids, 3))
    return DataProto.from_dict(tensors={
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": input_ids[:, prompt_width:].clone(),
        "response_mask": response_mask,
        "advantages": torch.randn(rows, response_width, generator=gen) * response_mask,
    })


def length_summary(data: DataProto) -> dict[str, float]:
    """Attended tokens per row (min / median / mean / max), their total and the padded layout's size."""
    lengths = data.batch["attention_mask"].sum(-1).double()
    return {"rows": len(lengths), "min": lengths.min().item(), "median": lengths.median().item(),
            "mean": lengths.mean().item(), "max": lengths.max().item(), "attended_tokens": lengths.sum().item(),
            "padded_tokens": float(data.batch["attention_mask"].numel()),
            "loss_tokens": float(data.batch["response_mask"].sum())}
