"""The planner's update pass and weight sync: one micro-batch's forward + backward at its peak moment, and the
bytes the weight sync holds beside the actor, from the memory model (:mod:`verl.utils.memory_model`) and FSDP2's
units and buffers (:mod:`verl.utils.memory_model_fsdp`), as the full-size trace measures them
(``python -m verl.trainer.trace_preset``)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from verl.utils import memory_model as mm
from verl.utils.memory_model_fsdp import FsdpUnits, fsdp2_update_moments, parameter_rows, sync_peak_bytes

if TYPE_CHECKING:
    from verl.trainer.plan_setup import MicroBatch, Setup


def update_pass_moments(s: Setup, model: str, mb: MicroBatch, compute_bytes: int, checkpointing: bool,
                        fsdp1_gathered: int) -> list[mm.PassPeak]:
    """The moments one update micro-batch of ``model`` (actor or critic) may peak at, FSDP's gathered units
    included: FSDP2's (:func:`verl.utils.memory_model_fsdp.fsdp2_update_moments`), or the model's with FSDP1's
    ``fsdp1_gathered`` (two layers and the root) held throughout."""
    critic = model == "critic"
    shape, lora = (s.critic, s.critic_lora) if critic else (s.actor, s.actor_lora)
    attn = s.cfg.actor_rollout_ref.model.attn_implementation
    entropy_grad = not critic and s.cfg.actor_rollout_ref.actor.entropy_coeff != 0
    terms = mm.update_terms(shape, mb.rows, mb.seq_len, mb.response_len, compute_bytes, checkpointing,
                            repeat_kv=attn != "flash_attention_2", head_positions=mb.response_len + 1,
                            entropy_grad=entropy_grad, frozen_base=lora is not None)
    tokens = mb.rows * mb.seq_len
    if critic:  # the value head's output is one number per position
        terms = dataclasses.replace(terms, logits=tokens * mm.FP32, logits_grad=tokens * mm.FP32)
    if lora is not None:  # the adapters' rank-r intermediates: of every layer, or with checkpointing one recomputed
        adapters = tokens * shape.lora_intermediate_bytes_per_token(lora.settings.rank, lora.modules, compute_bytes)
        terms = (dataclasses.replace(terms, layer_backward=terms.layer_backward + adapters // shape.num_layers)
                 if checkpointing else dataclasses.replace(terms, kept=terms.kept + adapters))
    strategy = (s.cfg.critic if critic else s.cfg.actor_rollout_ref.actor).strategy
    if strategy != "fsdp2":
        held = terms.kept + terms.edges
        return [mm.PassPeak(held, terms.logits, fsdp1_gathered, mm.LOGITS_BACKWARD),
                mm.PassPeak(held + terms.layer_backward, 0, fsdp1_gathered, mm.LAYER_BACKWARD)]
    units = FsdpUnits.of(shape, value_head=critic, adapter_params=lora.params if lora is not None else 0)
    return fsdp2_update_moments(terms, units, compute_bytes, trained=lora is None)


def sync_transient_bytes(s: Setup) -> int:
    """What the actor's side of the weight sync holds at its peak: its buckets gathered in the rollout dtype and
    copied out (the adapter's factors alone, held whole, when the rollout receives the adapter alone)."""
    bucket = int(s.cfg.actor_rollout_ref.rollout.update_weights_bucket_megabytes * 2**20)
    if s.syncs_adapter:
        rows = parameter_rows(s.actor, s.actor_lora.settings.rank, s.actor_lora.modules)
        return sync_peak_bytes(rows, s.world, s.compute_bytes, bucket, hold_all=True)
    return sync_peak_bytes(parameter_rows(s.actor), s.world, s.compute_bytes, bucket, hold_all=False)
