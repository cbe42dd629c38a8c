"""One training step on the traced rank, phase by phase: the passes the workers run, at the shapes of the
config's largest micro-batch, under a :class:`~verl.utils.memory_trace.MemoryTrace`.

Each pass runs the workers' own forward (:func:`verl.workers.packing.packed_forward_log_probs` on one packed row,
or :func:`verl.workers.actor.dp_actor.padded_log_probs` on padded rows; the critic's values alike); the update adds
the clipped PPO loss with the configured entropy bonus and KL loss (the critic's: the clipped value loss;
``verl.trainer.ppo.core_algos``, tensors of (rows, responses) floats), the backward pass, gradient clipping and the
AdamW step; the weight sync runs :func:`verl.workers.rollout.vllm_rollout.sync_actor_weights` into
:class:`RecordingEngine`. The offload keys
decide which models' parameters and optimizer states count as on the GPU in a phase, as the workers' ``on_device``
blocks move them. Data-dependent steps (packing a padded batch, the global token counts, reading the gradient
norm) cannot run on fake tensors: the micro-batch is built in its layout (one packed row, or padded rows), the
loss's token counts are the micro-batch's own and the norm is not read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from verl.trainer.ppo import core_algos
from verl.trainer.trace_models import TracedModels
from verl.utils.lora import adapters_disabled
from verl.utils.memory_trace import GATHERED, GRADIENTS, OPTIMIZER, WEIGHTS, MemoryTrace
from verl.utils.packed_attention import enable_packed_attention
from verl.workers.actor.dp_actor import padded_log_probs
from verl.workers.critic.dp_critic import padded_values
from verl.workers.fsdp_models import trainable_parameters
from verl.workers.packing import PackedBatch, packed_forward_log_probs, packed_forward_values
from verl.workers.rollout.vllm_rollout import WeightSyncStats, sync_actor_weights


@dataclass(frozen=True)
class MicroBatchShape:
    """The largest micro-batch of a pass: sequences of ``seq_lens`` tokens whose last ``responses`` tokens are
    the responses, in one packed row or (``packed`` false) as padded rows of the longest."""

    seq_lens: tuple[int, ...]
    responses: tuple[int, ...]
    packed: bool

    @property
    def tokens(self) -> int:
        """Tokens through the model (packed: the attended ones; padded: rows x width)."""
        return sum(self.seq_lens) if self.packed else len(self.seq_lens) * max(self.seq_lens)

    @property
    def response_width(self) -> int:
        """Responses of the padded (rows, R) layout."""
        return max(self.responses)


def micro_batch_shape(seq_len: int, response_len: int, rows: int, token_budget: int | None,
                      packed: bool) -> MicroBatchShape:
    """``rows`` full rows, or with a token budget (``use_dynamic_bsz``) as many full rows as it holds and (packed)
    a shorter last sequence filling it, with the full rows' share of responses, as the planner assumes."""
    if token_budget is not None:
        rows = max(1, token_budget // seq_len)
    lens, responses = [seq_len] * rows, [response_len] * rows
    rest = token_budget - rows * seq_len if token_budget is not None else 0
    if packed and rest > 0:
        lens.append(rest)
        responses.append(max(1, rest * response_len // seq_len))
    return MicroBatchShape(tuple(lens), tuple(responses), packed)


def _packed_row(shape: MicroBatchShape) -> PackedBatch:
    """A packed row of ``shape`` (fake tensors; the sequence bounds real, as the attention reads them on the host)."""
    bounds = [0]
    for length in shape.seq_lens:
        bounds.append(bounds[-1] + length)
    with unset_fake_temporarily():
        cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    scored = sum(shape.responses)
    return PackedBatch(
        input_ids=torch.zeros((1, shape.tokens), dtype=torch.long),
        position_ids=torch.cat([torch.arange(n) for n in shape.seq_lens]).unsqueeze(0),
        cu_seqlens=cu_seqlens, max_seqlen=max(shape.seq_lens), logit_index=torch.arange(scored),
        scored=torch.ones((len(shape.seq_lens), shape.response_width), dtype=torch.bool),
    )  # fmt: skip


def _padded_micro(shape: MicroBatchShape) -> dict[str, torch.Tensor]:
    rows, width = len(shape.seq_lens), max(shape.seq_lens)
    return {"input_ids": torch.zeros((rows, width), dtype=torch.long),
            "attention_mask": torch.ones((rows, width), dtype=torch.long),
            "position_ids": torch.arange(width).expand(rows, width),
            "responses": torch.zeros((rows, shape.response_width), dtype=torch.long),
            "response_mask": torch.ones((rows, shape.response_width), dtype=torch.long)}


def policy_log_probs(module: torch.nn.Module, shape: MicroBatchShape, calculate_entropy: bool,
                     entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The actor's forward of one micro-batch (packed or padded, as the worker runs it)."""
    if shape.packed:
        labels = torch.zeros(sum(shape.responses), dtype=torch.long)
        return packed_forward_log_probs(module, _packed_row(shape), labels, 1.0, calculate_entropy, entropy_grad)
    return padded_log_probs(module, _padded_micro(shape), 1.0, calculate_entropy, entropy_grad)


def critic_values(module: torch.nn.Module, shape: MicroBatchShape) -> torch.Tensor:
    """The critic's forward of one micro-batch."""
    if shape.packed:
        return packed_forward_values(module, _packed_row(shape))
    return padded_values(module, _padded_micro(shape))


class RecordingEngine:
    """The colocated vLLM engine's end of a weight sync, recorded instead of loaded: the name and bytes of each
    tensor it receives (the engine's own copy of the weights is the planner's ``vllm`` line). Full weights are
    dropped one by one as vLLM loads them; an adapter is held whole, as vLLM takes it."""

    def __init__(self, weight_dtype: torch.dtype, bucket_bytes: int, base_loaded: bool = True):
        self.weight_dtype, self.bucket_bytes, self.base_loaded = weight_dtype, bucket_bytes, base_loaded
        self.received: list[tuple[str, int]] = []

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], stats: WeightSyncStats) -> None:
        """Record the stream's tensors one at a time."""
        for name, tensor in weights:
            self.received.append((name, tensor.numel() * tensor.element_size()))
        self.base_loaded = True

    def update_adapter(self, tensors: Iterable[tuple[str, torch.Tensor]], config: dict[str, Any],
                       stats: WeightSyncStats) -> None:
        """Record the adapter's tensors, all held until the last arrives."""
        adapter = dict(tensors)
        self.received += [(name, t.numel() * t.element_size()) for name, t in adapter.items()]


@dataclass
class StepSettings:
    """What the step's passes need from the config."""

    world: int
    log_prob: MicroBatchShape
    ref_log_prob: MicroBatchShape
    update: MicroBatchShape
    actor_section: Any  # the actor_rollout_ref.actor block
    param_offload: dict[str, bool]
    optimizer_offload: dict[str, bool]
    weight_dtype: torch.dtype
    bucket_bytes: int
    sync_weights: bool
    critic_values: MicroBatchShape | None = None
    critic_update: MicroBatchShape | None = None
    critic_section: Any = None
    accumulate: bool = True  # the update's mini-batch has several micro-batches: the traced one is not the first
    critic_accumulate: bool = True
    received: list[tuple[str, int]] = field(default_factory=list)


def _states(models: TracedModels) -> dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """(parameters and buffers, optimizer state tensors) of each model on the rank."""
    def optim_state(optimizer):
        return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]

    states = {"actor": ([*models.actor.parameters(), *models.actor.buffers()], optim_state(models.actor_optimizer))}
    if models.reference is not None:
        states["ref"] = ([*models.reference.parameters(), *models.reference.buffers()], [])
    if models.critic is not None:
        states["critic"] = ([*models.critic.parameters(), *models.critic.buffers()],
                            optim_state(models.critic_optimizer))
    return states


@contextlib.contextmanager
def _on_device(trace: MemoryTrace, models: TracedModels, settings: StepSettings, uses: str,
               update: bool = False) -> Iterator[None]:
    """Offloaded models' states off the count except ``uses``'s (and its optimizer state with ``update``)."""
    for model, (params, optim) in _states(models).items():
        trace.set_on_device(params, not settings.param_offload.get(model, False) or model == uses)
        trace.set_on_device(optim, not settings.optimizer_offload.get(model, False) or (update and model == uses))
    yield


def _loss(log_prob: torch.Tensor, entropy: torch.Tensor | None, ref_log_prob: torch.Tensor | None,
          section: Any, shape: MicroBatchShape, world: int) -> torch.Tensor:
    """The actor's loss of one micro-batch: clipped PPO, minus the entropy bonus, plus the KL loss."""
    mask = torch.ones_like(log_prob)
    counts = {"dp_size": world, "batch_num_tokens": float(sum(shape.responses)),
              "global_batch_size": float(len(shape.seq_lens))}
    mode = str(section.get("loss_agg_mode", "token-mean"))
    loss, _ = core_algos.get_policy_loss_fn("vanilla")(torch.zeros_like(log_prob), log_prob, mask, mask,
                                                         loss_agg_mode=mode, config=section, **counts)
    coeff = float(section.get("entropy_coeff", 0.0))
    if coeff and entropy is not None:
        loss = loss - coeff * core_algos.agg_loss(entropy, mask, mode, **counts)
    if ref_log_prob is not None:
        kld = core_algos.kl_penalty(log_prob, ref_log_prob, str(section.get("kl_loss_type", "low_var_kl")))
        loss = loss + float(section.get("kl_loss_coef", 0.001)) * core_algos.agg_loss(kld, mask, mode, **counts)
    return loss


def _earlier_micro_batches(trace: MemoryTrace, module: torch.nn.Module, accumulate: bool) -> None:
    """The gradients a mini-batch's earlier micro-batches leave (sharded, float32), when it has several: the traced
    micro-batch is then one that accumulates into them, as every micro-batch after the first does."""
    if accumulate:
        params = trainable_parameters(module)
        for param in params:
            param.grad = torch.zeros_like(param)
        trace.track([p.grad for p in params], GRADIENTS)


def _step(trace: MemoryTrace, module: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor,
          grad_clip: float | None) -> None:
    """Backward, gradient clipping (the norm is not read: fake) and the optimizer step, as the workers run them."""
    loss.backward()
    params = trainable_parameters(module)
    trace.categorize([p.grad for p in params if p.grad is not None], GRADIENTS)
    torch.nn.utils.clip_grad_norm_(params, max_norm=float(grad_clip) if grad_clip else float("inf"),
                                   error_if_nonfinite=False)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def trace_step(trace: MemoryTrace, models: TracedModels, settings: StepSettings) -> None:
    """Run one step's phases under ``trace`` (active): old and reference log-probs, the critic's values and
    update, the actor's update and the weight sync; each phase's peak lands in ``trace.phases``."""
    for name, (params, optim) in _states(models).items():
        trace.track(params, WEIGHTS)
        trace.track(optim, OPTIMIZER)
    actor_key, critic_key = "actor_rollout_ref.model.use_remove_padding", "critic.model.use_remove_padding"
    for module, shape, key in ((models.actor, settings.update, actor_key),
                               (models.reference, settings.ref_log_prob, actor_key),
                               (models.critic, settings.critic_update, critic_key)):
        if module is not None and shape.packed:  # as the workers' actor and critic switch them
            enable_packed_attention(module, key)
    with torch.no_grad():
        models.actor.eval()
        with _on_device(trace, models, settings, "actor"), trace.phase("old log-probs"):
            policy_log_probs(models.actor, settings.log_prob, calculate_entropy=True)
        reference = models.reference or models.actor
        with _on_device(trace, models, settings, "ref" if models.reference else "actor"), \
                trace.phase("reference log-probs"):
            with contextlib.nullcontext() if models.reference else adapters_disabled(models.actor):
                policy_log_probs(reference, settings.ref_log_prob, calculate_entropy=False)
        if models.critic is not None:
            models.critic.eval()
            with _on_device(trace, models, settings, "critic"), trace.phase("values (critic)"):
                critic_values(models.critic, settings.critic_values)
    if models.critic is not None:
        models.critic.train()
        _earlier_micro_batches(trace, models.critic, settings.critic_accumulate)
        with _on_device(trace, models, settings, "critic", update=True), trace.phase("update critic"):
            values = critic_values(models.critic, settings.critic_update)
            zeros, mask = torch.zeros_like(values), torch.ones_like(values)
            loss, _ = core_algos.compute_value_loss(values, zeros, zeros, mask,
                                                    float(settings.critic_section.get("cliprange_value", 0.5)))
            _step(trace, models.critic, models.critic_optimizer, loss, settings.critic_section.get("grad_clip", None))
    models.actor.train()
    _earlier_micro_batches(trace, models.actor, settings.accumulate)
    section, shape = settings.actor_section, settings.update
    with _on_device(trace, models, settings, "actor", update=True), trace.phase("update actor"):
        entropy_grad = float(section.get("entropy_coeff", 0.0)) != 0
        log_prob, entropy = policy_log_probs(models.actor, shape, calculate_entropy=True, entropy_grad=entropy_grad)
        ref = torch.zeros_like(log_prob) if section.get("use_kl_loss", False) else None
        _step(trace, models.actor, models.actor_optimizer, _loss(log_prob, entropy, ref, section, shape,
                                                                  settings.world), section.get("grad_clip", None))
        del log_prob, entropy
    if settings.sync_weights:
        engine = RecordingEngine(settings.weight_dtype, settings.bucket_bytes)
        with _on_device(trace, models, settings, "actor"), trace.phase("weight sync", default=GATHERED):
            sync_actor_weights(models.actor, engine, WeightSyncStats(), models.actor_lora)
        settings.received[:] = engine.received
