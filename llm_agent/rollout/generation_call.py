"""The agent side of a rollout turn: one `generate_sequences` call for some dialogues' contexts.

`AgentBatches` builds, from the shared token buffer, the left-padded batch of the rows whose agent turn is due
(padded to a multiple of the engine's world size, with the decoding meta of the rollout and the per-turn limit);
`GenerationCall.run` sends it to a `RolloutEngine` and returns each row's `SampledTurn`: the ids it sampled, the
engine's log-prob of each when it computed them (`rollout.calculate_log_probs`), and the policy version that
sampled. The sync loop makes one call per turn, the async engine one per micro-batch. Both loops hand each row's
turn to its environment's `step`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llm_agent.rollout.dialogue import TokenBuffer
from verl.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto
from verl.workers.rollout.engine import RolloutEngine, output_policy_version

__all__ = ["AgentBatches", "GenerationCall", "SampledTurn"]


@dataclass(frozen=True)
class SampledTurn:
    """One row's agent turn as the engine sampled it: the token ids (eos included when sampled), the engine's
    log-prob of each (`rollout_log_probs`, aligned with `ids`; None when the engine did not compute them) and the
    policy version that sampled them (None when not known)."""

    ids: torch.Tensor
    log_probs: torch.Tensor | None = None
    policy_version: int | None = None


class GenerationCall:
    """One `generate_sequences` batch for some buffer rows: built from the token buffer, run, checked."""

    def __init__(self, rows: list[int], batch: DataProto, pad_size: int, response_length: int) -> None:
        self.rows, self.batch, self.pad_size, self.response_length = rows, batch, pad_size, response_length

    def run(self, engine: RolloutEngine) -> list[SampledTurn]:
        """Generate the batch on `engine`; returns each row's sampled turn, in the order of `rows`: its `responses`
        up to its sampled length, with its `rollout_log_probs` when present and the generation's policy version."""
        generated = engine.generate_sequences(self.batch)
        version = output_policy_version(generated, engine)
        out = unpad_dataproto(generated, self.pad_size)
        responses = out.batch["responses"]
        if responses.size(0) != len(self.rows) or responses.size(1) > self.response_length:
            raise RuntimeError(f"generate_sequences returned responses of shape {tuple(responses.shape)} for "
                               f"{len(self.rows)} rows and response_length {self.response_length}")
        lengths = out.batch["attention_mask"][:, -responses.size(1):].sum(dim=1).tolist()
        log_probs = out.batch["rollout_log_probs"] if "rollout_log_probs" in out.batch.keys() else None
        if log_probs is not None and log_probs.shape != responses.shape:
            raise RuntimeError(f"generate_sequences returned rollout_log_probs of shape {tuple(log_probs.shape)} "
                               f"for responses of shape {tuple(responses.shape)}")
        return [SampledTurn(responses[i, :n], None if log_probs is None else log_probs[i, :n], version)
                for i, n in enumerate(lengths)]


class AgentBatches:
    """Builds the generation batch of some rows of `buffer`: their contexts, the rollout's decoding `meta`
    (from the trainer), the eos/pad ids and a per-call `response_length` of at most `max_tokens_per_turn` (and no
    more than the longest remaining budget among the rows)."""

    def __init__(self, buffer: TokenBuffer, meta: dict[str, Any], eos_id: int, pad_id: int,
                 max_tokens_per_turn: int) -> None:
        self.buffer, self.meta = buffer, meta
        self.eos_id, self.pad_id, self.max_tokens_per_turn = eos_id, pad_id, max_tokens_per_turn

    def __call__(self, rows: list[int], world_size: int) -> GenerationCall:
        """The left-padded batch of `rows`' contexts, padded to a multiple of `world_size` rows."""
        response_length = min(self.max_tokens_per_turn, max(self.buffer.remaining(r) for r in rows))
        batch = DataProto.from_dict(tensors=self.buffer.context_batch(rows), meta_info={
            **self.meta, "eos_token_id": self.eos_id, "pad_token_id": self.pad_id,
            "response_length": response_length})
        padded, pad_size = pad_dataproto_to_divisor(batch, world_size)
        return GenerationCall(rows, padded, pad_size, response_length)
