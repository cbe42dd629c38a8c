"""The log-probs of the tokens HF ``generate`` samples, recorded while it samples (``calculate_log_probs``)."""

from __future__ import annotations

import torch
from transformers import LogitsProcessor


class SampledTokenLogProbs(LogitsProcessor):
    """A pass-through logits processor recording log softmax(logits / temperature) of every sampled token, the
    log-prob the actor computes for it (no top-k / top-p renormalisation).

    ``generate`` calls processors in order with the logits of the next position; custom processors come before
    its sampling warpers, so the scores seen here are the model's. Each call gathers the previous step's log-prob
    of the token just appended to ``input_ids``; :meth:`log_probs` adds the last step's. Memory: one (bs, vocab)
    row of log-probs at a time.
    """

    def __init__(self, temperature: float):
        if not temperature > 0:
            raise ValueError(f"calculate_log_probs needs a temperature > 0, got {temperature}")
        self.temperature = float(temperature)
        self._previous: torch.Tensor | None = None
        self._gathered: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._previous is not None:
            self._gathered.append(self._previous.gather(1, input_ids[:, -1:]).squeeze(1))
        self._previous = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def log_probs(self, generated: torch.Tensor) -> torch.Tensor:
        """(bs, steps) float32 log-probs of ``generated`` (the new tokens, bs x steps); 0 where nothing was sampled."""
        columns = list(self._gathered)
        if self._previous is not None:
            columns.append(self._previous.gather(1, generated[:, len(columns):len(columns) + 1]).squeeze(1))
        out = torch.zeros(generated.shape, dtype=torch.float32, device=generated.device)
        if columns:
            out[:, :len(columns)] = torch.stack(columns, dim=1)[:, :generated.size(1)]
        return out
