"""Padding-free (packed) forward passes of the actor and the critic (veRL's ``use_remove_padding``).

A micro-batch in the padded layout (``input_ids`` / ``attention_mask`` / ``position_ids`` (bs, L), the last R
columns the responses) becomes one packed row: the attended tokens of every row back to back, with their own
position ids and the sequence boundaries (``cu_seq_lens``) that the attention (see
:mod:`verl.utils.packed_attention`) uses to keep the sequences apart. Only the outputs that predict a response
token go through the LM head. Results come back in the padded (bs, R) layout:

- a response token is *scored* when it and the token before it are both attended (``attention_mask`` 1); its
  log-prob, entropy or value equals the padded forward's at that position (up to float rounding);
- every other response position (padding after the response) is 0; the padded path leaves arbitrary values
  there, and no loss or metric reads them (``response_mask`` is 0 on them).

User-turn tokens inside a multi-turn response are attended and scored like the agent's own tokens; the
``response_mask`` decides what carries loss, exactly as in the padded path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict

from verl.utils.torch_functional import log_probs_and_entropy


@dataclass
class PackedBatch:
    """One packed row built from a padded micro-batch, and the map back to its (bs, R) response layout."""

    input_ids: torch.Tensor  # (1, T) attended tokens of all rows, row after row
    position_ids: torch.Tensor  # (1, T) the padded layout's position ids of those tokens
    cu_seqlens: torch.Tensor  # (bs + 1,) int32 cumulative token counts: row i is [cu[i], cu[i+1])
    max_seqlen: int  # longest row's token count
    logit_index: torch.Tensor  # (K,) packed positions whose output predicts a scored response token
    scored: torch.Tensor  # (bs, R) bool: which response positions are scored

    def model_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the HF model call (no attention mask; boundaries as flash-attention kwargs)."""
        return {
            "input_ids": self.input_ids, "position_ids": self.position_ids, "attention_mask": None,
            "cu_seq_lens_q": self.cu_seqlens, "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_seqlen, "max_length_k": self.max_seqlen, "use_cache": False,
        }  # fmt: skip

    def to_response_layout(self, values: torch.Tensor) -> torch.Tensor:
        """Scatter (K,) per-scored-token values into a (bs, R) tensor, 0 on unscored positions (differentiable)."""
        out = values.new_zeros(self.scored.shape)
        return out.masked_scatter(self.scored, values)


def pack_batch(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, response_length: int
) -> PackedBatch:
    """Pack a padded micro-batch (bs, L) whose last ``response_length`` columns are the responses."""
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape or position_ids.shape != input_ids.shape:
        raise ValueError(
            f"pack_batch: input_ids {tuple(input_ids.shape)}, attention_mask {tuple(attention_mask.shape)} and "
            f"position_ids {tuple(position_ids.shape)} must share one (bs, L) shape"
        )
    width = input_ids.shape[1]
    if not 0 < response_length < width:
        raise ValueError(f"responses of length {response_length} do not fit in input_ids of length {width}")
    attended = attention_mask.bool()
    flat = attended.reshape(-1)
    seqlens = attended.sum(dim=1)
    cu_seqlens = torch.zeros(seqlens.numel() + 1, dtype=torch.int32, device=input_ids.device)
    cu_seqlens[1:] = seqlens.cumsum(0)
    packed_pos = (flat.long().cumsum(0) - 1).reshape(attended.shape)
    before = slice(width - response_length - 1, width - 1)
    scored = attended[:, before] & attended[:, width - response_length :]
    return PackedBatch(
        input_ids=input_ids.reshape(-1)[flat].unsqueeze(0),
        position_ids=position_ids.reshape(-1)[flat].unsqueeze(0),
        cu_seqlens=cu_seqlens,
        max_seqlen=int(seqlens.max()) if seqlens.numel() else 0,
        logit_index=packed_pos[:, before][scored],
        scored=scored,
    )


def packed_log_probs(
    module: torch.nn.Module, micro: TensorDict, temperature: float, calculate_entropy: bool, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (bs, R) of ``micro['responses']`` (and entropies) from one packed forward of a causal LM.

    Logits are only computed at the scored positions (``logits_to_keep``) and stay in the model's dtype. The
    entropy carries gradient only with ``entropy_grad``.
    """
    responses = micro["responses"]
    packed = pack_batch(micro["input_ids"], micro["attention_mask"], micro["position_ids"], responses.size(-1))
    return packed_forward_log_probs(module, packed, responses[packed.scored], temperature, calculate_entropy,
                                    entropy_grad)


def packed_forward_log_probs(
    module: torch.nn.Module, packed: PackedBatch, labels: torch.Tensor, temperature: float, calculate_entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The forward of :func:`packed_log_probs` on a packed row; ``labels`` (K,) are its scored response tokens."""
    output = module(**packed.model_kwargs(), logits_to_keep=packed.logit_index)
    log_probs, entropy = log_probs_and_entropy(output.logits[0], labels, temperature)  # (K,)
    if not calculate_entropy:
        return packed.to_response_layout(log_probs), None
    entropy = entropy if entropy_grad else entropy.detach()
    return packed.to_response_layout(log_probs), packed.to_response_layout(entropy)


def packed_values(module: torch.nn.Module, micro: TensorDict) -> torch.Tensor:
    """Values (bs, R) of the states preceding each response token from one packed forward of a value model
    (one scalar per position), zeroed outside ``response_mask``."""
    response_mask = micro["response_mask"]
    packed = pack_batch(micro["input_ids"], micro["attention_mask"], micro["position_ids"], response_mask.size(-1))
    values = packed_forward_values(module, packed)
    return values * response_mask.to(values.dtype)


def packed_forward_values(module: torch.nn.Module, packed: PackedBatch) -> torch.Tensor:
    """The forward of :func:`packed_values` on a packed row: values (bs, R), 0 on unscored positions."""
    output = module(**packed.model_kwargs())
    return packed.to_response_layout(output.logits[0, packed.logit_index, 0].float())
