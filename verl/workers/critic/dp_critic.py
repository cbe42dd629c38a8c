"""DataParallelPPOCritic: token values and the clipped value-function update of a (possibly FSDP-sharded) model."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from omegaconf import DictConfig
from tensordict import TensorDict

from verl.protocol import DataProto
from verl.trainer.ppo import core_algos
from verl.utils.fsdp_utils import clip_grad_norm
from verl.utils.packed_attention import enable_packed_attention
from verl.utils.torch_functional import masked_mean
from verl.workers.batching import (
    check_divisible,
    global_loss_info,
    iter_mini_batches,
    mask_padding_rows,
    restore_row_order,
    select_batch,
    split_micro_batches,
)
from verl.workers.packing import packed_values
from verl.workers.metric_buffer import MetricBuffer

logger = logging.getLogger(__name__)

MODEL_INPUT_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
UPDATE_KEYS = MODEL_INPUT_KEYS + ("values", "returns")


def padded_values(module: torch.nn.Module, micro: TensorDict) -> torch.Tensor:
    """Values (bs, R) of the states preceding each response token from one forward of the padded micro-batch,
    zeroed outside ``response_mask``."""
    response_length = micro["responses"].size(-1)
    output = module(
        input_ids=micro["input_ids"],
        attention_mask=micro["attention_mask"],
        position_ids=micro["position_ids"],
        use_cache=False,
    )
    values = output.logits[:, -response_length - 1 : -1, 0].float()
    return values * micro["response_mask"].to(values.dtype)


class DataParallelPPOCritic:
    """PPO critic over one data-parallel shard of the batch (veRL's ``DataParallelPPOCritic``).

    ``module`` maps tokens to one scalar per position (e.g. ``AutoModelForTokenClassification`` with
    ``num_labels=1``). The value of response token t is read at the position preceding it, i.e. the value of
    the state from which that token is generated. ``config`` is the ``critic`` block with
    ``ppo_mini_batch_size`` already in rows per mini-batch on this rank. ``config.use_remove_padding`` (copied
    by the worker from ``critic.model.use_remove_padding``) runs the forwards on packed rows;
    ``config.use_dynamic_bsz`` forms the update's micro-batches by ``ppo_max_token_len_per_gpu`` tokens.
    """

    def __init__(self, config: DictConfig, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None):
        self.config = config
        self.critic_module = module
        self.critic_optimizer = optimizer
        self.loss_agg_mode = str(config.get("loss_agg_mode", "token-mean"))
        if self.loss_agg_mode not in core_algos.LOSS_AGG_MODES:
            raise ValueError(
                f"critic.loss_agg_mode={self.loss_agg_mode!r}; expected one of {list(core_algos.LOSS_AGG_MODES)}"
            )
        self.use_remove_padding = bool(config.get("use_remove_padding", False))
        self.use_dynamic_bsz = bool(config.get("use_dynamic_bsz", False))
        if self.use_remove_padding:
            enable_packed_attention(module, "critic.model.use_remove_padding")

    @property
    def device(self) -> torch.device:
        """Device of the module's parameters (where inputs are moved)."""
        return next(self.critic_module.parameters()).device

    def _forward_micro_batch(self, micro: TensorDict) -> torch.Tensor:
        """Values (bs, R) of the states preceding each response token, zeroed outside ``response_mask``."""
        if self.use_remove_padding:
            return packed_values(self.critic_module, micro)
        return padded_values(self.critic_module, micro)

    @torch.no_grad()
    def compute_values(self, data: DataProto) -> torch.Tensor:
        """Values (bs, R) for ``data``, no grad, micro-batched by ``meta_info['micro_batch_size']`` rows or, with
        ``meta_info['use_dynamic_bsz']``, by ``meta_info['max_token_len']`` tokens (row order restored)."""
        meta = data.meta_info
        max_token_len = int(meta["max_token_len"]) if meta.get("use_dynamic_bsz", False) else None
        if max_token_len is None and "micro_batch_size" not in meta:
            raise KeyError("compute_values: meta_info['micro_batch_size'] (rows per forward pass) is required")
        batch = select_batch(data, MODEL_INPUT_KEYS, "compute_values")
        micros, parts = split_micro_batches(
            batch, int(meta.get("micro_batch_size", 0)), max_token_len, "critic.forward_max_token_len_per_gpu"
        )
        was_training = self.critic_module.training
        self.critic_module.eval()
        try:
            values = [self._forward_micro_batch(micro.to(self.device)).cpu() for micro in micros]
        finally:
            self.critic_module.train(was_training)
        return restore_row_order(values, parts)

    def _optimizer_step(self) -> tuple[float, bool]:
        """Clip gradients to ``grad_clip`` and step, unless the norm is not finite; returns (norm, stepped)."""
        grad_norm = clip_grad_norm(self.critic_module, self.config.get("grad_clip", None))
        if not math.isfinite(grad_norm):
            logger.warning("critic: grad norm is %s; skipping this optimizer step", grad_norm)
            self.critic_optimizer.zero_grad(set_to_none=True)
            return grad_norm, False
        self.critic_optimizer.step()
        self.critic_optimizer.zero_grad(set_to_none=True)
        return grad_norm, True

    def update_critic(self, data: DataProto) -> dict[str, list[float]]:
        """Run ``ppo_epochs`` passes of the clipped value loss over ``data``; return the metrics as lists.

        Needs ``values`` (the old values), ``returns`` and ``response_mask``. Mini-/micro-batching (token budgets
        included), global normalisation, DP padding rows and non-finite-gradient skipping work as in the actor.
        ``critic/vf_loss`` gets one value per mini-batch (this rank's share; the mean over ranks is the mini-batch
        loss).
        """
        if self.critic_optimizer is None:
            raise RuntimeError("update_critic: this critic was built without an optimizer")
        cfg = self.config
        batch = select_batch(mask_padding_rows(data, "update_critic"), UPDATE_KEYS, "update_critic")
        mini_batch_size = int(cfg.ppo_mini_batch_size)
        micro_batch_size = int(cfg.get("ppo_micro_batch_size_per_gpu", 0) or 0)
        max_token_len = int(cfg.ppo_max_token_len_per_gpu) if self.use_dynamic_bsz else None
        check_divisible(batch.batch_size[0], mini_batch_size, "ppo_mini_batch_size (rows per rank)", "update_critic")
        if max_token_len is None:
            check_divisible(mini_batch_size, micro_batch_size, "ppo_micro_batch_size_per_gpu", "update_critic")
        cliprange_value = float(cfg.get("cliprange_value", 0.5))
        metrics: dict[str, list[float]] = {}
        self.critic_module.train()
        self.critic_optimizer.zero_grad(set_to_none=True)
        epochs, shuffle = int(cfg.get("ppo_epochs", 1)), bool(cfg.get("shuffle", False))
        for mini in iter_mini_batches(batch, mini_batch_size, epochs, shuffle):
            mini = mini.to(self.device)
            loss_info = global_loss_info(mini["response_mask"], cfg.get("loss_scale_factor", None))
            vf_loss_total: Any = 0.0
            buffer = MetricBuffer()  # read once per mini-batch, not per micro-batch
            micros, _ = split_micro_batches(mini, micro_batch_size, max_token_len, "critic.ppo_max_token_len_per_gpu")
            for micro in micros:
                vpreds = self._forward_micro_batch(micro)
                vf_loss, vf_clipfrac = core_algos.compute_value_loss(
                    vpreds, micro["returns"], micro["values"], micro["response_mask"],
                    cliprange_value, loss_agg_mode=self.loss_agg_mode, **loss_info,
                )  # fmt: skip
                vf_loss.backward()
                vf_loss_total = vf_loss_total + vf_loss.detach()
                vpred_mean = masked_mean(vpreds.detach(), micro["response_mask"])
                buffer.add({"critic/vf_clipfrac": vf_clipfrac, "critic/vpred_mean": vpred_mean})
            grad_norm, stepped = self._optimizer_step()
            step_metrics = {"critic/vf_loss": vf_loss_total, "critic/grad_norm": grad_norm}
            buffer.add({**step_metrics, "critic/grad_norm_nonfinite": float(not stepped)})
            buffer.flush_into(metrics)
        return metrics
