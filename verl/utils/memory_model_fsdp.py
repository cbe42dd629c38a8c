"""FSDP2's side of the memory model: its units, what it holds gathered at each moment of an update pass, the
collectives a pass issues, and the buckets of the vLLM weight sync.

The workers wrap every decoder layer, the input embedding and the output head as units of their own, then the root
(final norm, a value head; embedding and head too when they are tied), :func:`verl.utils.fsdp_utils.apply_fsdp2`.
What FSDP2 (torch 2.11-2.13) keeps alive, as the full-size trace measured it (``python -m verl.trainer.trace_preset``):

* forward: a unit's unsharded parameters and the all-gather buffer they were copied out of, kept until the next
  unit's copy-out (:func:`verl.utils.memory_model.sharded_state`: twice the largest unit);
* backward: a unit's unsharded parameters, the next unit prefetched, the unsharded gradients of the unit, and the
  previous unit's reduce-scatter input (its full gradient in float32, the reduce dtype), freed only at the next
  reduce-scatter. The peak of an update pass is then the logits' backward (nothing gathered), the head's backward
  (the head gathered with its gradient), the first decoder layer's backward (the head's float32 reduce-scatter
  buffer beside two layers and one weight's gradient) or the second's (the first layer's buffer instead, which is
  larger when a layer outweighs the head), whichever holds most (:func:`fsdp2_update_moments`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from verl.utils.memory_model import (FP32, HEAD_BACKWARD, LAYER_BACKWARD, LOGITS_BACKWARD, ModelShape, PassPeak,
                                     UpdateTerms)

SECOND_LAYER_BACKWARD = "the second layer's backward"


@dataclass(frozen=True)
class FsdpUnits:
    """Parameters of a model's FSDP2 units: one decoder layer (with its adapter), the embedding and the head (0
    when they live in the root), the root, and a layer's largest weight matrix."""

    layers: int
    layer: int
    embedding: int
    head: int
    root: int
    largest_weight: int

    @classmethod
    def of(cls, shape: ModelShape, value_head: bool = False, adapter_params: int = 0) -> FsdpUnits:
        """The units of ``shape`` (a causal LM, or with ``value_head`` a value model) with a LoRA adapter of
        ``adapter_params`` spread over its layers."""
        h = shape.hidden_size
        root = h + (h + 1 if value_head else 0)
        embedding, head = shape.embedding_params, 0 if value_head else shape.head_params
        if shape.tie_word_embeddings and not value_head:  # one parameter in both: neither can be a unit of its own
            root, embedding, head = root + embedding, 0, 0
        layers = shape.num_layers
        largest = max(i * o for i, o in shape.linear_layers.values())
        return cls(layers, shape.layer_params + adapter_params // max(layers, 1), embedding, head, root, largest)

    @property
    def count(self) -> int:
        """How many units (each one all-gather per pass)."""
        return self.layers + (1 if self.embedding else 0) + (1 if self.head else 0) + 1

    @property
    def params(self) -> int:
        """All parameters of the units."""
        return self.layers * self.layer + self.embedding + self.head + self.root


def fsdp2_update_moments(terms: UpdateTerms, units: FsdpUnits, compute_bytes: int, trained: bool) -> list[PassPeak]:
    """The moments of one micro-batch's forward + backward under FSDP2 that may be its peak (module docstring): the
    logits' backward, the head's backward and a first decoder layer's backward, with what FSDP2 holds gathered at
    each. ``trained``: every weight is trained (False: a LoRA model, whose frozen weights get no gradient and
    whose head and embedding units reduce-scatter nothing)."""
    b = compute_bytes
    held = terms.kept + terms.edges
    root = units.root * b
    head_backward = (units.head * (2 if trained else 1) + units.layer) * b + root
    in_layer = 2 * units.layer * b + root + (units.largest_weight * b if trained else 0)
    moments = [PassPeak(held, terms.logits, root, LOGITS_BACKWARD),
               PassPeak(held, terms.logits_grad, head_backward, HEAD_BACKWARD),
               PassPeak(held + terms.layer_backward, 0, in_layer + (units.head * FP32 if trained else 0),
                        LAYER_BACKWARD)]
    if trained:  # the second layer's backward: the first layer's reduce-scatter buffer, one layer's saved tensors gone
        moments.append(PassPeak(held - terms.kept // max(units.layers, 1) + terms.layer_backward, 0,
                                in_layer + units.layer * FP32, SECOND_LAYER_BACKWARD))
    return moments


@dataclass(frozen=True)
class PassCollectives:
    """The collectives of one pass over a model: all-gathers in the compute dtype and reduce-scatters in float32,
    each as (count, bytes of their full buffers)."""

    all_gathers: tuple[int, int]
    reduce_scatters: tuple[int, int] = (0, 0)


def pass_collectives(units: FsdpUnits, compute_bytes: int, training: bool, trainable_params: int,
                     trainable_units: int) -> PassCollectives:
    """What FSDP2 issues for one micro-batch: every unit all-gathered once in the forward pass and once more in
    the backward pass; each unit holding ``trainable`` parameters reduce-scatters their gradients in float32."""
    gathered = units.params * compute_bytes
    if not training:
        return PassCollectives((units.count, gathered))
    return PassCollectives((2 * units.count, 2 * gathered), (trainable_units, trainable_params * FP32))


def _padded(numel_rows: int, row: int, world: int) -> int:
    """Elements of a parameter of ``numel_rows`` rows of ``row`` elements as FSDP2 shards it: ceil(rows / world)
    rows on every rank."""
    return math.ceil(numel_rows / world) * row * world


def parameter_rows(shape: ModelShape, adapter_rank: int = 0, adapter_modules: tuple[str, ...] = ()
                   ) -> list[tuple[int, int]]:
    """(rows, elements per row) of the causal LM's parameters in module order (Qwen2 / Llama); with an adapter,
    only its factors (A: rank x in, B: out x rank), as the adapter-only sync sends them."""
    h, layers = shape.hidden_size, shape.linear_layers
    if adapter_rank:
        per_layer = [f for name, (i, o) in layers.items() if name in adapter_modules
                     for f in ((adapter_rank, i), (o, adapter_rank))]
        return per_layer * shape.num_layers
    layer: list[tuple[int, int]] = []
    for name, (i, o) in layers.items():
        layer.append((o, i))
        if shape.qkv_bias and name in ("q_proj", "k_proj", "v_proj"):
            layer.append((o, 1))
    layer += [(h, 1), (h, 1)]  # the two RMSNorms
    tail = [(h, 1)] + ([] if shape.tie_word_embeddings else [(shape.vocab_size, h)])
    return [(shape.vocab_size, h)] + layer * shape.num_layers + tail


def sync_buckets(rows: list[tuple[int, int]], world: int, dtype_bytes: int, bucket_bytes: int) -> list[list[int]]:
    """The weight sync's buckets (:mod:`verl.workers.rollout.vllm_rollout.weight_sync`): consecutive parameters of
    at most ``bucket_bytes`` in full size (a larger one alone), each as the parameters' full element counts."""
    buckets: list[list[int]] = []
    size = 0
    for count, row in rows:
        nbytes = count * row * dtype_bytes
        if buckets and size + nbytes <= bucket_bytes:
            buckets[-1].append(count * row)
            size += nbytes
        else:
            buckets.append([count * row])
            size = nbytes
    return buckets


def sync_peak_bytes(rows: list[tuple[int, int]], world: int, dtype_bytes: int, bucket_bytes: int,
                    hold_all: bool) -> int:
    """The weight sync's transient peak on one rank: a bucket's shards padded and concatenated (twice its send
    buffer), the gathered buffer, the full tensors copied out of it (none for a bucket of one parameter, which is a
    view), beside the last tensor of the previous bucket (``hold_all``: every earlier tensor, as an adapter is
    taken whole)."""
    full = [count * row for count, row in rows]
    padded = [_padded(count, row, world) for count, row in rows]
    peak, held, index = 0, 0, 0
    for bucket in sync_buckets(rows, world, dtype_bytes, bucket_bytes):
        n = len(bucket)
        gathered = sum(padded[index: index + n]) * dtype_bytes
        copies = sum(full[index: index + n]) * dtype_bytes if n > 1 else 0
        peak = max(peak, held + 2 * gathered // world + gathered + copies)
        last = full[index + n - 1] * dtype_bytes if n > 1 else gathered
        held = held + (copies or gathered) if hold_all else last
        index += n
    return peak
