"""DataParallelPPOActor: log-probabilities and the clipped-PPO policy update of a (possibly FSDP-sharded) LM."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from omegaconf import DictConfig
from tensordict import TensorDict

from verl.protocol import DataProto
from verl.trainer.ppo import core_algos
from verl.utils.agent_turns import AGENT_TURN_IDS
from verl.utils.fsdp_utils import clip_grad_norm
from verl.utils.packed_attention import enable_packed_attention
from verl.utils.torch_functional import log_probs_and_entropy
from verl.workers.batching import (
    check_divisible,
    global_loss_info,
    iter_mini_batches,
    mask_padding_rows,
    response_logits,
    restore_row_order,
    select_batch,
    split_micro_batches,
)
from verl.workers.packing import packed_log_probs
from verl.workers.metric_buffer import MetricBuffer

logger = logging.getLogger(__name__)

MODEL_INPUT_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")
UPDATE_KEYS = MODEL_INPUT_KEYS + ("response_mask", "old_log_probs", "advantages")
OPTIONAL_UPDATE_KEYS = ("rollout_is_weights", AGENT_TURN_IDS)  # used when the batch has them (rollout correction)


def padded_log_probs(
    module: torch.nn.Module, micro: TensorDict, temperature: float, calculate_entropy: bool, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (bs, R) of ``micro['responses']`` (and entropies) from one forward of the padded micro-batch: the
    head runs on the last R + 1 positions only (those predicting responses)."""
    responses = micro["responses"]
    output = module(
        input_ids=micro["input_ids"],
        attention_mask=micro["attention_mask"],
        position_ids=micro["position_ids"],
        use_cache=False,
        logits_to_keep=responses.size(-1) + 1,
    )
    logits = response_logits(output.logits, responses.size(-1))
    log_probs, entropy = log_probs_and_entropy(logits, responses, temperature)
    if not calculate_entropy:
        return log_probs, None
    return log_probs, entropy if entropy_grad else entropy.detach()


class DataParallelPPOActor:
    """PPO actor over one data-parallel shard of the batch (veRL's ``DataParallelPPOActor``).

    ``config`` is the ``actor_rollout_ref.actor`` block, with ``ppo_mini_batch_size`` already converted to rows
    per mini-batch *on this rank* (the worker multiplies by ``rollout.n`` and divides by the DP size).
    ``module`` is a causal LM (plain, FSDP2- or FSDP1-sharded); ``optimizer`` is only needed for :meth:`update_policy`.
    ``config.use_remove_padding`` runs every forward on packed rows (:mod:`verl.workers.packing`; the worker
    copies it from ``actor_rollout_ref.model.use_remove_padding``); ``config.use_dynamic_bsz`` forms the update's
    micro-batches by ``ppo_max_token_len_per_gpu`` tokens instead of ``ppo_micro_batch_size_per_gpu`` rows.
    ``config.policy_loss.loss_mode`` names the registered policy loss (default ``vanilla``; the trainer sets
    ``bypass_mode`` for rollout correction's bypass mode); batch ``rollout_is_weights`` multiply the token losses.
    """

    def __init__(self, config: DictConfig, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None):
        self.config = config
        self.actor_module = module
        self.actor_optimizer = optimizer
        self.loss_agg_mode = str(config.get("loss_agg_mode", "token-mean"))
        if self.loss_agg_mode not in core_algos.LOSS_AGG_MODES:
            raise ValueError(
                f"actor.loss_agg_mode={self.loss_agg_mode!r}; expected one of {list(core_algos.LOSS_AGG_MODES)}"
            )
        self.loss_mode = str((config.get("policy_loss", None) or {}).get("loss_mode", "vanilla"))
        self.policy_loss_fn = core_algos.get_policy_loss_fn(self.loss_mode)
        self.use_remove_padding = bool(config.get("use_remove_padding", False))
        self.use_dynamic_bsz = bool(config.get("use_dynamic_bsz", False))
        if self.use_remove_padding:
            enable_packed_attention(module, "actor_rollout_ref.model.use_remove_padding")

    @property
    def device(self) -> torch.device:
        """Device of the module's parameters (where inputs are moved)."""
        return next(self.actor_module.parameters()).device

    def _forward_micro_batch(
        self, micro: TensorDict, temperature: float, calculate_entropy: bool, entropy_grad: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (bs, R) of ``responses`` under the model, and their entropies when asked.

        The entropy carries gradient only with ``entropy_grad`` (when it is part of the loss). Padded: logits
        of the last R + 1 positions only; packed: of the scored response positions only; in the model's dtype
        either way, log-softmax in float32 chunk by chunk.
        """
        if self.use_remove_padding:
            return packed_log_probs(self.actor_module, micro, temperature, calculate_entropy, entropy_grad)
        return padded_log_probs(self.actor_module, micro, temperature, calculate_entropy, entropy_grad)

    @torch.no_grad()
    def compute_log_prob(
        self, data: DataProto, calculate_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (bs, R) of ``data.batch['responses']`` (and entropies when asked), micro-batched, no grad.

        ``meta_info``: ``micro_batch_size`` (rows per forward) or, with ``use_dynamic_bsz`` true,
        ``max_token_len`` (tokens per forward; rows are regrouped and their order restored), and
        ``temperature`` (default 1.0).
        """
        meta = data.meta_info
        max_token_len = int(meta["max_token_len"]) if meta.get("use_dynamic_bsz", False) else None
        if max_token_len is None and "micro_batch_size" not in meta:
            raise KeyError("compute_log_prob: meta_info['micro_batch_size'] (rows per forward pass) is required")
        temperature = float(meta.get("temperature", 1.0))
        batch = select_batch(data, MODEL_INPUT_KEYS, "compute_log_prob")
        micros, parts = split_micro_batches(
            batch, int(meta.get("micro_batch_size", 0)), max_token_len, "log_prob_max_token_len_per_gpu"
        )
        was_training = self.actor_module.training
        self.actor_module.eval()
        log_probs, entropies = [], []
        try:
            for micro in micros:
                log_prob, entropy = self._forward_micro_batch(micro.to(self.device), temperature, calculate_entropy)
                log_probs.append(log_prob.float().cpu())
                if entropy is not None:
                    entropies.append(entropy.float().cpu())
        finally:
            self.actor_module.train(was_training)
        entropy = restore_row_order(entropies, parts) if calculate_entropy else None
        return restore_row_order(log_probs, parts), entropy

    def _micro_batch_loss(
        self, micro: TensorDict, temperature: float, loss_info: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """This micro-batch's share of the mini-batch loss (global normalisation) and its metrics."""
        cfg = self.config
        entropy_coeff = float(cfg.get("entropy_coeff", 0.0))
        mask = micro["response_mask"]
        log_prob, entropy = self._forward_micro_batch(
            micro, temperature, calculate_entropy=True, entropy_grad=entropy_coeff != 0
        )
        extra = {"turn_ids": micro.get(AGENT_TURN_IDS, None)} if self.loss_mode == "bypass_mode" else {}
        pg_loss, metrics = self.policy_loss_fn(
            micro["old_log_probs"], log_prob, micro["advantages"], mask, loss_agg_mode=self.loss_agg_mode,
            config=cfg, rollout_is_weights=micro.get("rollout_is_weights", None), **extra, **loss_info,
        )  # fmt: skip
        entropy_loss = core_algos.agg_loss(entropy, mask, self.loss_agg_mode, **loss_info)
        loss = pg_loss - entropy_coeff * entropy_loss if entropy_coeff != 0 else pg_loss
        metrics.update({"actor/pg_loss": pg_loss.detach(), "actor/entropy": entropy_loss.detach()})
        if cfg.get("use_kl_loss", False):
            kld = core_algos.kl_penalty(log_prob, micro["ref_log_prob"], str(cfg.get("kl_loss_type", "low_var_kl")))
            kl_loss = core_algos.agg_loss(kld, mask, self.loss_agg_mode, **loss_info)
            loss = loss + float(cfg.get("kl_loss_coef", 0.001)) * kl_loss
            metrics["actor/kl_loss"] = kl_loss.detach()
        return loss, metrics

    def _optimizer_step(self) -> tuple[float, bool]:
        """Clip gradients to ``grad_clip`` and step, unless the norm is not finite; returns (norm, stepped)."""
        grad_norm = clip_grad_norm(self.actor_module, self.config.get("grad_clip", None))
        if not math.isfinite(grad_norm):
            logger.warning("actor: grad norm is %s; skipping this optimizer step", grad_norm)
            self.actor_optimizer.zero_grad(set_to_none=True)
            return grad_norm, False
        self.actor_optimizer.step()
        self.actor_optimizer.zero_grad(set_to_none=True)
        return grad_norm, True

    def update_policy(self, data: DataProto) -> dict[str, list[float]]:
        """Run ``ppo_epochs`` passes of clipped-PPO over ``data`` and return the metrics as lists.

        Each mini-batch (``ppo_mini_batch_size`` rows on this rank) is one optimizer step, accumulated over
        micro-batches of ``ppo_micro_batch_size_per_gpu`` rows (``use_dynamic_bsz``: of at most
        ``ppo_max_token_len_per_gpu`` tokens; the same gradient, the normalisation being global). The loss is
        policy loss - entropy_coeff * entropy (+ kl_loss_coef * KL to ``ref_log_prob`` with ``use_kl_loss``),
        normalised by the mini-batch's token/sequence counts over all ranks; padding rows of the DP dispatch carry
        no loss. A step whose gradient norm is not finite is skipped and counted in ``actor/grad_norm_nonfinite``.
        ``meta_info['temperature']`` divides the logits (default 1.0).
        ``actor/pg_loss``, ``actor/entropy`` and ``actor/kl_loss`` get one value per mini-batch: this rank's
        share of it, so their mean over ranks is the mini-batch's value; the clip/KL fractions one per micro-batch.
        """
        if self.actor_optimizer is None:
            raise RuntimeError("update_policy: this actor was built without an optimizer")
        cfg = self.config
        keys = UPDATE_KEYS + (("ref_log_prob",) if cfg.get("use_kl_loss", False) else ())
        keys += tuple(k for k in OPTIONAL_UPDATE_KEYS if data.batch is not None and k in data.batch.keys())
        batch = select_batch(mask_padding_rows(data, "update_policy"), keys, "update_policy")
        mini_batch_size = int(cfg.ppo_mini_batch_size)
        micro_batch_size = int(cfg.get("ppo_micro_batch_size_per_gpu", 0) or 0)
        max_token_len = int(cfg.ppo_max_token_len_per_gpu) if self.use_dynamic_bsz else None
        check_divisible(batch.batch_size[0], mini_batch_size, "ppo_mini_batch_size (rows per rank)", "update_policy")
        if max_token_len is None:
            check_divisible(mini_batch_size, micro_batch_size, "ppo_micro_batch_size_per_gpu", "update_policy")
        temperature = float(data.meta_info.get("temperature", 1.0))
        epochs = int(cfg.get("ppo_epochs", 1))
        metrics: dict[str, list[float]] = {}
        self.actor_module.train()
        self.actor_optimizer.zero_grad(set_to_none=True)
        for mini in iter_mini_batches(batch, mini_batch_size, epochs, bool(cfg.get("shuffle", False))):
            mini = mini.to(self.device)
            loss_info = global_loss_info(mini["response_mask"], cfg.get("loss_scale_factor", None))
            totals: dict[str, Any] = {}
            buffer = MetricBuffer()  # read once per mini-batch, not per micro-batch
            micros, _ = split_micro_batches(mini, micro_batch_size, max_token_len, "actor.ppo_max_token_len_per_gpu")
            for micro in micros:
                loss, micro_metrics = self._micro_batch_loss(micro, temperature, loss_info)
                loss.backward()
                for name in ("actor/pg_loss", "actor/entropy", "actor/kl_loss"):
                    if name in micro_metrics:
                        totals[name] = totals.get(name, 0.0) + micro_metrics.pop(name)
                buffer.add(micro_metrics)
            grad_norm, stepped = self._optimizer_step()
            buffer.add(totals)
            buffer.add({"actor/grad_norm": grad_norm, "actor/grad_norm_nonfinite": float(not stepped)})
            buffer.flush_into(metrics)
        return metrics
