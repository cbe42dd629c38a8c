"""Reference log-probs computed with a plain Hugging Face model, for checking the workers' own."""
from __future__ import annotations

import torch

from verl.protocol import DataProto

from tests.helpers.ppo_batch_helpers import RESPONSE_LEN


def hf_logprobs(model: torch.nn.Module, data: DataProto) -> torch.Tensor:
    """Log-probs of the responses under a plain HF model (the reference for the worker's)."""
    b = data.batch
    with torch.no_grad():
        logits = model(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
        ).logits
    logits = logits[:, -RESPONSE_LEN - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)
