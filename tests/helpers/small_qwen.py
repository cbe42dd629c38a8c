"""A small randomly initialised Qwen2 model and inputs for it, for measuring real passes on CPU."""
from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

SMALL = {"model_type": "qwen2", "vocab_size": 2048, "hidden_size": 128, "intermediate_size": 384,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}


def small_model(dtype: torch.dtype) -> Qwen2ForCausalLM:
    """The SMALL Qwen2 model (seed 0, sdpa attention) in `dtype`."""
    torch.manual_seed(0)
    config = Qwen2Config(**{k: v for k, v in SMALL.items() if k != "model_type"}, attn_implementation="sdpa")
    return Qwen2ForCausalLM(config).to(dtype)


def small_inputs(rows: int, seq_len: int, padded: bool) -> dict[str, torch.Tensor]:
    """Random input ids, attention mask and position ids; `padded` left-pads the first row by 5 tokens."""
    mask = torch.ones(rows, seq_len, dtype=torch.long)
    if padded:
        mask[0, :5] = 0
    return {"input_ids": torch.randint(0, SMALL["vocab_size"], (rows, seq_len)), "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
