"""A random actor-update batch of full-length rows, for the benchmarks (no Ray needed: bench/gpu_check.py)."""
from __future__ import annotations

import torch

from verl.protocol import DataProto


def make_batch(batch: int, prompt_length: int, response_length: int, vocab: int, seed: int = 0) -> DataProto:
    """Random full-length sequences with the keys update_actor needs (old_log_probs added later)."""
    gen = torch.Generator().manual_seed(seed)
    total = prompt_length + response_length
    input_ids = torch.randint(0, vocab, (batch, total), generator=gen)
    return DataProto.from_dict(tensors={
        "input_ids": input_ids, "attention_mask": torch.ones(batch, total, dtype=torch.long),
        "position_ids": torch.arange(total).expand(batch, total).clone(),
        "responses": input_ids[:, prompt_length:].clone(),
        "response_mask": torch.ones(batch, response_length, dtype=torch.long),
        "advantages": torch.randn(batch, response_length, generator=gen),
    })
