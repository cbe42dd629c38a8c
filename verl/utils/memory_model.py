"""Analytic per-GPU memory and time model of the FSDP PPO workers (used by ``python -m verl.trainer.plan``).

Every number is in bytes (memory) or FLOPs and derives from the HF ``config.json`` shape and the trainer config:

* Parameters are counted exactly from the shape (Qwen2 / Llama / Mistral decoder layers: attention with optional
  q/k/v bias, SwiGLU MLP, two RMSNorms per layer, untied or tied head).
* FSDP2 keeps fp32 master shards (4 B/param / world), fp32 sharded gradients during an update and AdamW's two fp32
  moments (8 B/param / world); what it holds gathered (in the compute dtype) and its reduce-scatter buffers (in
  float32) at each moment of a pass: :mod:`verl.utils.memory_model_fsdp`.
* Activations are the tensors autograd saves per token and decoder layer (HF eager modules, SDPA/flash
  attention, no dropout): two RMSNorms (fp32 copy + normed output + its cast), the rotated q/k, v, the
  attention output (also the output projection's input) and its log-sum-exp, and four SwiGLU intermediates. With
  gradient checkpointing only each layer's input is saved, plus one layer recomputed in the backward pass. A
  pass's peak is the largest of its moments (:class:`PassPeak`): a no-grad forward's layer, head or log-softmax;
  an update's logits' backward or first layer's backward.
* Logits: the head's output (the positions that predict response tokens) in the compute dtype, kept as it is for
  the backward pass, its gradient (same size and dtype) and a few float32 chunks of the chunked log-softmax.
* KV cache of HF generation: 2 x layers x kv_heads x head_dim per token in the compute dtype.
* FLOPs (:class:`PassFlops`): matmul weights x tokens, causal attention counted by query-key pairs, the head on
  the positions it runs on, the backward at twice the forward and the checkpointing recompute kept apart (MFU
  vs HFU).
* LoRA (:func:`lora_sharded_state`): the frozen base sharded in the compute dtype, the adapter's float32 master
  weights, gradients and AdamW moments (r x (in + out) per adapted linear layer and decoder layer); the backward of
  a frozen linear layer computes its input's gradient only (1 x its forward instead of 2 x); the activations are
  the full model's plus each adapter's rank-r intermediate (an upper bound: a frozen layer that is not adapted
  keeps no input for its weight's gradient).

The CPU tests (tests/verl/utils/test_memory_model.py) check these against peaks measured with the torch profiler;
the full-size trace (``python -m verl.trainer.trace_preset``, tests/verl/trainer/test_trace_preset.py) holds the
planner built on them to what one step of the GPU presets allocates at 7B and 14B.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

GIB = 1024**3
FP32 = 4


@dataclass(frozen=True)
class ModelShape:
    """The shape of a decoder-only transformer as read from an HF ``config.json``."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    qkv_bias: bool

    @classmethod
    def from_hf_config(cls, config: dict) -> "ModelShape":
        """Read the shape from a parsed ``config.json`` (raises naming a missing key)."""
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
            if key not in config:
                raise KeyError(f"config.json lacks {key!r}; the memory model needs a decoder-only LM config")
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config["intermediate_size"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=config.get("model_type") == "qwen2" or bool(config.get("attention_bias", False)),
        )

    @classmethod
    def from_model_dir(cls, path: str | Path) -> "ModelShape":
        """Read ``<path>/config.json``."""
        file = Path(path) / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"no config.json in the model directory {path!r}")
        return cls.from_hf_config(json.loads(file.read_text()))

    @property
    def q_dim(self) -> int:
        """Width of the query projection (heads x head_dim)."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the key (= value) projection."""
        return self.num_kv_heads * self.head_dim

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one decoder layer's matrix multiplications (q, k, v, o projections and the SwiGLU MLP)."""
        h = self.hidden_size
        return 2 * h * self.q_dim + 2 * h * self.kv_dim + 3 * h * self.intermediate_size

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer."""
        h = self.hidden_size
        attention = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        bias = self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0
        return attention + bias + 3 * h * self.intermediate_size + 2 * h

    @property
    def embedding_params(self) -> int:
        """Parameters of the input embedding."""
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        """Parameters of the LM head (0 when tied to the embedding)."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def num_params(self, value_head: bool = False) -> int:
        """All parameters of the causal LM, or of the value model (backbone + a 1-output scored head)."""
        backbone = self.embedding_params + self.num_layers * self.layer_params + self.hidden_size
        if value_head:
            return backbone + self.hidden_size + 1
        return backbone + self.head_params

    def activation_bytes_per_token(self, dtype_bytes: int, repeat_kv: bool = True) -> int:
        """Bytes autograd saves per token and decoder layer without checkpointing.

        ``repeat_kv``: keys/values are expanded to all query heads before SDPA (HF does so whenever an attention
        mask is passed, i.e. for padded batches); flash attention and mask-free SDPA use the kv heads as they are.
        """
        h, b = self.hidden_size, dtype_bytes
        norms = 2 * (FP32 * h + 2 * b * h)
        kv_heads = self.num_heads if repeat_kv else self.num_kv_heads
        attention = b * (2 * self.q_dim + 2 * kv_heads * self.head_dim) + FP32 * self.num_heads
        mlp = 4 * b * self.intermediate_size
        return norms + attention + mlp

    def forward_transient_bytes_per_token(self, dtype_bytes: int) -> int:
        """Peak bytes per token of one layer's forward without autograd (the SwiGLU intermediates dominate)."""
        return 3 * dtype_bytes * self.intermediate_size + 2 * FP32 * self.hidden_size

    def kv_cache_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of HF generation's KV cache per token of context."""
        return 2 * self.num_layers * self.kv_dim * dtype_bytes

    @property
    def linear_layers(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of a decoder layer, by its HF module name (Qwen2 / Llama)."""
        h, i = self.hidden_size, self.intermediate_size
        return {"q_proj": (h, self.q_dim), "k_proj": (h, self.kv_dim), "v_proj": (h, self.kv_dim),
                "o_proj": (self.q_dim, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def lora_params(self, rank: int, modules: Iterable[str]) -> int:
        """Parameters of a rank-``rank`` LoRA adapter on ``modules`` (HF names) of every decoder layer: A (r x in)
        and B (out x r) per adapted layer. Raises naming a module that is no linear layer of the shape."""
        unknown = sorted(set(modules) - set(self.linear_layers))
        if unknown:
            raise KeyError(f"{unknown} name no linear layer of the decoder (its linear layers are "
                           f"{sorted(self.linear_layers)})")
        return self.num_layers * sum(rank * sum(self.linear_layers[m]) for m in set(modules))

    def lora_intermediate_bytes_per_token(self, rank: int, modules: Iterable[str], dtype_bytes: int) -> int:
        """Bytes per token of the adapters' rank-r intermediates (A x, saved for B's gradient) over all layers."""
        return self.num_layers * len(set(modules)) * rank * dtype_bytes


LOGITS_BACKWARD, HEAD_BACKWARD = "the logits' backward", "the head's backward"  # moments of an update pass
LAYER_BACKWARD = "the first layer's backward"
LOGPROB_CHUNK_BYTES = 2**24 * FP32  # one (rows, vocab) fp32 chunk of verl.utils.torch_functional's log-prob
# chunks alive at once in the chunked log-softmax, in float32 chunks, when it runs several (a single chunk holds one
# fewer in the backward pass): forward (the scaled logits, probabilities, their product and its masked copy, and the
# bool mask: a quarter), backward (the same, the chunk's gradient, the previous chunk's last temporaries; two more
# when the entropy is in the loss); counted by the full-size trace (python -m verl.trainer.trace_preset)
CHUNK_TEMPORARIES = {"forward": 4.25, "backward": 5, "backward with entropy": 7}


@dataclass(frozen=True)
class PassPeak:
    """Bytes of one micro-batch's pass at its peak: autograd-held activations and logits (incl. temporaries), and
    the FSDP units gathered at that moment when the model of the pass counts them."""

    activations: int
    logits: int
    gathered: int = 0
    moment: str = ""  # when in the pass

    @property
    def total(self) -> int:
        """activations + logits + gathered."""
        return self.activations + self.logits + self.gathered


def largest(moments: list[PassPeak]) -> PassPeak:
    """The moment holding the most bytes."""
    return max(moments, key=lambda peak: peak.total)


@dataclass(frozen=True)
class UpdateTerms:
    """The parts of one micro-batch's forward + backward that its peak is made of.

    ``kept``: what the decoder stack keeps for the backward pass (every layer's activations, or with checkpointing
    each layer's input); ``edges``: the final norm's and the embedding's saved tensors; ``layer_backward``: one
    decoder layer's backward beyond ``kept`` (with checkpointing its recomputed activations, and one SwiGLU-wide
    gradient either way); ``logits``: the logits in training (:func:`logits_bytes`); ``logits_grad``: the head
    output's gradient alone (what is left of the logits while the head's backward runs).
    """

    kept: int
    edges: int
    layer_backward: int
    logits: int
    logits_grad: int


def logits_bytes(
    shape: ModelShape, rows: int, seq_len: int, response_len: int, dtype_bytes: int, training: bool,
    head_positions: int | None = None, entropy_grad: bool = False,
) -> int:
    """Peak bytes of the logits of one micro-batch.

    The head produces ``head_positions`` of each row (default every position) in the compute dtype; the log-prob
    and entropy read them in float32 chunks of at most :data:`LOGPROB_CHUNK_BYTES`, within one row (a padded row's
    responses are not contiguous with the next row's; a packed micro-batch is one row), a few of them alive at once
    (:data:`CHUNK_TEMPORARIES`). In training the head's output is kept for the backward pass, which writes its
    gradient (the same size and dtype) one chunk at a time (more temporaries with ``entropy_grad``: the entropy in
    the loss).
    """
    positions = seq_len if head_positions is None else head_positions
    head_out = rows * positions * shape.vocab_size * dtype_bytes
    chunk = min(response_len * shape.vocab_size * FP32, LOGPROB_CHUNK_BYTES)
    if training:
        chunks = CHUNK_TEMPORARIES["backward with entropy" if entropy_grad else "backward"]
        if rows == 1 and response_len * shape.vocab_size * FP32 <= LOGPROB_CHUNK_BYTES:
            chunks -= 1  # a single chunk: no temporaries left from the one before
        return int(2 * head_out + chunks * chunk)
    return int(head_out + CHUNK_TEMPORARIES["forward"] * chunk)


def update_pass_peak(
    shape: ModelShape, rows: int, seq_len: int, response_len: int, dtype_bytes: int, checkpointing: bool,
    repeat_kv: bool = True, head_positions: int | None = None, entropy_grad: bool = False,
) -> PassPeak:
    """Peak of a forward + backward pass of one micro-batch (gradients and weights not included): the logits'
    backward, while the decoder stack keeps what it saved, or the first decoder layer's backward (with
    checkpointing: that layer recomputed), whichever is larger (:class:`UpdateTerms`)."""
    terms = update_terms(shape, rows, seq_len, response_len, dtype_bytes, checkpointing, repeat_kv, head_positions,
                         entropy_grad)
    held = terms.kept + terms.edges
    return largest([PassPeak(held, terms.logits, moment=LOGITS_BACKWARD),
                    PassPeak(held + terms.layer_backward, 0, moment=LAYER_BACKWARD)])


def update_terms(
    shape: ModelShape, rows: int, seq_len: int, response_len: int, dtype_bytes: int, checkpointing: bool,
    repeat_kv: bool = True, head_positions: int | None = None, entropy_grad: bool = False, frozen_base: bool = False,
) -> UpdateTerms:
    """The :class:`UpdateTerms` of ``rows`` sequences of ``seq_len`` tokens (``head_positions`` of each through the
    head, default all); a ``frozen_base`` (LoRA) final norm keeps no normed output for its weight's gradient."""
    tokens = rows * seq_len
    h, b = shape.hidden_size, dtype_bytes
    per_layer = tokens * shape.activation_bytes_per_token(b, repeat_kv)
    swiglu_grad = tokens * shape.intermediate_size * b
    positions = rows * (seq_len if head_positions is None else head_positions)
    return UpdateTerms(
        kept=shape.num_layers * (tokens * b * h if checkpointing else per_layer),
        edges=tokens * (FP32 + (0 if frozen_base else 2 * b)) * h,  # the final norm's fp32 copy, normed output, cast
        layer_backward=(per_layer if checkpointing else 0) + swiglu_grad,
        logits=logits_bytes(shape, rows, seq_len, response_len, b, True, head_positions, entropy_grad),
        logits_grad=positions * shape.vocab_size * b,
    )  # fmt: skip


def forward_pass_peak(
    shape: ModelShape, rows: int, seq_len: int, response_len: int, dtype_bytes: int, with_logits: bool = True,
    head_positions: int | None = None, gathered: int = 0, released_before_logits: bool = False,
) -> PassPeak:
    """The largest of :func:`forward_pass_moments`."""
    return largest(forward_pass_moments(shape, rows, seq_len, response_len, dtype_bytes, with_logits,
                                        head_positions, gathered, released_before_logits))


def forward_pass_moments(
    shape: ModelShape, rows: int, seq_len: int, response_len: int, dtype_bytes: int, with_logits: bool = True,
    head_positions: int | None = None, gathered: int = 0, released_before_logits: bool = False,
) -> list[PassPeak]:
    """The moments a no-grad forward of one micro-batch (log-probs or values) may peak at: one layer's transients,
    or the head's output, beside the hidden states (and the head's input, the rows of the positions it runs on),
    or the head's output alone with the log-softmax's chunks. ``gathered``: the FSDP units held meanwhile, all of
    them gone before the log-softmax with ``released_before_logits`` (FSDP2 reshards at the end of the forward)."""
    layer = rows * seq_len * shape.forward_transient_bytes_per_token(dtype_bytes)
    positions = rows * (seq_len if head_positions is None else head_positions)  # through the head
    hidden = rows * seq_len * shape.hidden_size * dtype_bytes
    head_input = positions * shape.hidden_size * dtype_bytes if head_positions is not None else 0
    moments = [PassPeak(hidden + layer, 0, gathered, "a decoder layer")]
    if with_logits:
        logits = logits_bytes(shape, rows, seq_len, response_len, dtype_bytes, False, head_positions)
        head_out = positions * shape.vocab_size * dtype_bytes
        moments += [PassPeak(hidden + head_input, head_out, gathered, "the head"),  # the log-softmax: after the forward
                    PassPeak(0, logits, 0 if released_before_logits else gathered, "the log-softmax")]
    return moments


def kv_cache_bytes(shape: ModelShape, rows: int, context_len: int, dtype_bytes: int) -> int:
    """KV cache of ``rows`` sequences of ``context_len`` tokens."""
    return rows * context_len * shape.kv_cache_bytes_per_token(dtype_bytes)


@dataclass(frozen=True)
class ShardedState:
    """Per-GPU bytes of one FSDP model's persistent state."""

    params: int
    grads: int
    optimizer: int
    gathered: int

    @property
    def resident(self) -> int:
        """Bytes held between phases (master shards + optimizer state; gradients are freed after each step)."""
        return self.params + self.optimizer


def sharded_state(
    shape: ModelShape, world: int, compute_bytes: int, master_bytes: int, trainable: bool, value_head: bool = False,
    separate_embedding_units: bool = False,
) -> ShardedState:
    """Sharded master weights, gradients and AdamW state, and the peak of gathered units during a forward pass.

    ``gathered``, in the compute dtype: FSDP1 holds two decoder layers (current + prefetched) and the root unit
    (embedding, final norm, head) for the whole pass; FSDP2 with embedding and head as units of their own
    (``separate_embedding_units``) holds the unit being computed twice, its parameters and the all-gather buffer
    they were copied out of (kept until the next unit's copy-out), so twice the largest unit, plus the root (final
    norm, a value head).
    """
    total = shape.num_params(value_head)
    head = shape.hidden_size + 1 if value_head else shape.head_params
    if separate_embedding_units:
        unit = max(shape.layer_params, shape.embedding_params, 0 if value_head else head)
        gathered = (2 * unit + shape.hidden_size + (head if value_head else 0)) * compute_bytes
    else:
        gathered = (2 * shape.layer_params + shape.embedding_params + head + shape.hidden_size) * compute_bytes
    params = total * master_bytes // world
    grads = total * FP32 // world if trainable else 0
    optimizer = 2 * total * FP32 // world if trainable else 0
    return ShardedState(params=params, grads=grads, optimizer=optimizer, gathered=gathered)


def lora_sharded_state(
    shape: ModelShape, world: int, compute_bytes: int, adapter_params: int, value_head: bool = False,
    separate_embedding_units: bool = False,
) -> ShardedState:
    """A LoRA model's per-GPU state: the frozen base's shards in the compute dtype and the adapter's (with a value
    model's head, trained whole) float32 master shards, gradients and AdamW moments; gathered units as the full
    model's (the adapter's share of a layer is small but counted)."""
    trainable = adapter_params + (shape.hidden_size + 1 if value_head else 0)
    full = sharded_state(shape, world, compute_bytes, compute_bytes, False, value_head, separate_embedding_units)
    per_layer_adapter = adapter_params // max(shape.num_layers, 1)
    return ShardedState(params=full.params + trainable * FP32 // world, grads=trainable * FP32 // world,
                        optimizer=2 * trainable * FP32 // world,
                        gathered=full.gathered + 2 * per_layer_adapter * compute_bytes)


@dataclass(frozen=True)
class PassFlops:
    """FLOPs of one pass over a batch, split the way MFU (model FLOPs) and HFU (hardware FLOPs) count them.

    ``dense_forward``: 2 x the decoder layers' matmul weights x every token, plus 2 x hidden x head outputs x the
    positions that go through the head (the embedding is a lookup: 0 FLOPs; norms, biases, activations and the
    softmax are elementwise and not counted). ``attention_forward``: causal attention, QK^T and PV at 2 x head_dim
    FLOPs per query-key pair and head, T(T+1)/2 pairs per sequence of T tokens. The backward pass costs twice the
    forward; ``recompute_forward`` is what gradient checkpointing runs again during the backward pass: each decoder
    layer's forward (attention included, the head not) up to its last saved tensor, i.e. without the MLP's down
    projection, whose output nothing saves (non-reentrant ``torch.utils.checkpoint`` stops recomputing there).
    """

    dense_forward: float
    attention_forward: float
    recompute_forward: float = 0.0
    frozen_dense: bool = False  # LoRA: no weight gradients of the base's matmuls (its backward is 1 x, not 2 x)
    adapter: float = 0.0  # forward FLOPs of LoRA's rank-r matmuls (their backward: 2 x)

    @property
    def forward(self) -> float:
        """Forward FLOPs (what a no-grad log-prob or value pass costs)."""
        return self.dense_forward + self.attention_forward + self.adapter

    @property
    def model(self) -> float:
        """Model FLOPs of forward + backward, the numerator of MFU; recompute not counted: 3 x the forward, or with
        a frozen base 2 x its matmuls + 3 x attention and the adapters."""
        if not self.frozen_dense:
            return 3.0 * self.forward
        return 2.0 * self.dense_forward + 3.0 * (self.attention_forward + self.adapter)

    @property
    def hardware(self) -> float:
        """FLOPs the GPU executes: model FLOPs plus the checkpointing recompute, the numerator of HFU."""
        return self.model + self.recompute_forward


def causal_attention_flops(shape: ModelShape, seq_lens: list[int]) -> float:
    """Forward FLOPs of causal self-attention over sequences of ``seq_lens`` tokens (packed sequences attend only
    within themselves): 2 matmuls x 2 x head_dim FLOPs x heads x layers x T(T+1)/2 query-key pairs each."""
    pairs = sum(t * (t + 1) // 2 for t in seq_lens)
    return 4.0 * shape.num_layers * shape.q_dim * pairs


def pass_flops(
    shape: ModelShape, seq_lens: list[int], head_positions: int, checkpointing: bool, value_head: bool = False,
    lora_params: int = 0,
) -> PassFlops:
    """:class:`PassFlops` of sequences of ``seq_lens`` tokens of which ``head_positions`` go through the LM head
    (the actor computes logits on the positions that predict response tokens only) or the 1-output value head;
    ``lora_params`` > 0: a frozen base trained through an adapter of that many parameters."""
    head_outputs = 1 if value_head else shape.vocab_size
    layers_dense = 2.0 * shape.num_layers * shape.layer_matmul_params * sum(seq_lens)
    attention = causal_attention_flops(shape, seq_lens)
    down_projection = 2.0 * shape.num_layers * shape.hidden_size * shape.intermediate_size * sum(seq_lens)
    adapter = 2.0 * lora_params * sum(seq_lens)
    return PassFlops(dense_forward=layers_dense + 2.0 * shape.hidden_size * head_outputs * head_positions,
                     attention_forward=attention,
                     recompute_forward=layers_dense - down_projection + attention + adapter if checkpointing else 0.0,
                     frozen_dense=lora_params > 0, adapter=adapter)


def training_flops(
    shape: ModelShape, rows: int, seq_len: int, checkpointing: bool, value_head: bool = False,
    head_positions: int | None = None, lora_params: int = 0,
) -> float:
    """Hardware FLOPs of forward + backward of ``rows`` sequences of ``seq_len`` tokens (:class:`PassFlops`;
    ``head_positions`` defaults to every position; ``lora_params``: a LoRA adapter's size, 0 = full training)."""
    heads = rows * seq_len if head_positions is None else head_positions
    return pass_flops(shape, [seq_len] * rows, heads, checkpointing, value_head, lora_params).hardware


def forward_flops(
    shape: ModelShape, rows: int, seq_len: int, value_head: bool = False, head_positions: int | None = None,
) -> float:
    """FLOPs of one forward pass of ``rows`` sequences (dense + causal attention, :class:`PassFlops`)."""
    heads = rows * seq_len if head_positions is None else head_positions
    return pass_flops(shape, [seq_len] * rows, heads, False, value_head).forward
