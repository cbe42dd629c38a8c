"""Supervised fine-tuning of a local causal LM on token rows with a loss mask: in one process, or sharded with
FSDP2 over every rank of a `torchrun` launch.

`train_sft(model_path, rows, out_dir, config)` minimises, per optimizer step, the mean next-token negative
log-likelihood over the loss-carrying tokens of the step's batch (a token mean over the whole batch, however it
is split into micro-batches and ranks; a row's loss mask may also weigh tokens, making it a weighted mean). Each step takes `config.batch_size` rows, drawn epoch by epoch in an
order shuffled by `random.Random(config.seed)` (the same on every rank). AdamW at `config.lr` with an optional
linear warm-up and cosine decay (`verl.utils.optim.lr_factor`), the gradient's global norm clipped to
`config.grad_clip` (its norm before clipping is logged per step).

Launched by `torchrun --nproc_per_node N` (WORLD_SIZE > 1), every rank joins one process group (NCCL on CUDA,
gloo on CPU), rank 0 reads the checkpoint and the model is sharded with FSDP2
(`verl.utils.fsdp_utils.build_fsdp_model`); each rank trains on every N-th row of a batch and scales its loss
by N / (the batch's loss tokens on all ranks), so FSDP's gradient averaging yields the global token mean. In one
process the model is trained as it is (CUDA when available). Either way rank 0 writes a Hugging Face model
directory (`AutoModelForCausalLM.from_pretrained` and vLLM load it), the tokenizer and `sft_log.json` (settings,
per-step loss, wall time).
"""
from __future__ import annotations

import gc
import inspect
import json
import logging
import math
import os
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from verl.utils.device import get_dist_backend, is_cuda_available
from verl.utils.file_modes import weights_like_the_rest
from verl.utils.optim import WARMUP_STYLES, lr_factor

logger = logging.getLogger(__name__)

__all__ = ["LOG_FILE", "SFTConfig", "SFTRow", "assistant_nll", "batch_schedule", "collate", "train_sft"]

LOG_FILE = "sft_log.json"
EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class SFTRow:
    """Token ids of one training sequence and its loss mask: 1 exactly on the tokens that carry loss (or, more
    generally, each token's non-negative loss weight; 0 = no loss)."""

    input_ids: list[int]
    loss_mask: list[float]


@dataclass(frozen=True)
class SFTConfig:
    """Optimisation settings of `train_sft`.

    `batch_size` rows per optimizer step (all ranks together; a multiple of the world size under torchrun),
    `micro_batch_size` rows per forward/backward on one rank (None: the rank's whole share of the batch),
    `warmup_steps` of linear warm-up, then `lr_schedule` `constant` or `cosine` (down to `min_lr_ratio`),
    `param_dtype` the compute dtype (`auto`: bf16 on CUDA, fp32 on CPU; the weights the optimizer updates stay
    fp32), `export_dtype` the dtype of the exported weights (`fp32` or `bf16`), `reshard_after_forward` whether
    FSDP2 frees a layer's gathered weights after its forward (False keeps them for the backward: the same arithmetic
    with fewer all-gathers, at the cost of the whole model's weights on every rank).
    """

    steps: int
    lr: float
    batch_size: int = 8
    micro_batch_size: int | None = None
    seed: int = 0
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    min_lr_ratio: float = 0.0
    gradient_checkpointing: bool = False
    param_dtype: str = "auto"
    export_dtype: str = "fp32"
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.steps, int) or self.steps < 1:
            problems.append(f"steps must be an integer >= 1, got {self.steps!r}")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            problems.append(f"batch_size must be an integer >= 1, got {self.batch_size!r}")
        if self.micro_batch_size is not None and (not isinstance(self.micro_batch_size, int)
                                                  or self.micro_batch_size < 1):
            problems.append(f"micro_batch_size must be None or an integer >= 1, got {self.micro_batch_size!r}")
        for name in ("lr", "grad_clip", "weight_decay", "min_lr_ratio"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                problems.append(f"{name} must be a finite number >= 0, got {value!r}")
        if isinstance(self.lr, (int, float)) and self.lr == 0:
            problems.append("lr must be > 0")
        if not isinstance(self.warmup_steps, int) or not 0 <= self.warmup_steps <= max(self.steps, 0):
            problems.append(f"warmup_steps must be an integer in [0, steps], got {self.warmup_steps!r}")
        if self.lr_schedule not in WARMUP_STYLES:
            problems.append(f"lr_schedule must be one of {WARMUP_STYLES}, got {self.lr_schedule!r}")
        if self.param_dtype not in ("auto", "fp32", "bf16"):
            problems.append(f"param_dtype must be auto, fp32 or bf16, got {self.param_dtype!r}")
        if not isinstance(self.reshard_after_forward, bool):
            problems.append(f"reshard_after_forward must be true or false, got {self.reshard_after_forward!r}")
        if self.export_dtype not in EXPORT_DTYPES:
            problems.append(f"export_dtype must be one of {sorted(EXPORT_DTYPES)}, got {self.export_dtype!r}")
        if problems:
            raise ValueError("SFTConfig: " + "; ".join(problems))


def masked_nll_sum(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor
                   ) -> tuple[torch.Tensor, float]:
    """Next-token negative log-likelihood summed over the positions, weighted by loss_mask (1: the token carries
    loss), and the sum of the weights (the count of loss-carrying tokens for a 0/1 mask).

    Token t is predicted from the logits at t-1, so the first token of a row never carries loss. The LM head runs
    only at the positions that predict a loss-carrying token in some row (transformers' `logits_to_keep`, where the
    model's forward takes it): the same sum, without the vocabulary-wide logits of the prompt and user tokens."""
    weights = loss_mask[:, 1:]
    if _takes_logits_to_keep(model):
        keep = weights.ne(0).any(dim=0).nonzero().flatten()
        logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep).logits.float()
        targets, weights = input_ids[:, 1:][:, keep], weights[:, keep]
    else:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
        targets = input_ids[:, 1:]
    weights = weights.to(logits.dtype)
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                            reduction="none").view_as(weights)
    return (nll * weights).sum(), float(weights.sum().item())


def _takes_logits_to_keep(model: Any) -> bool:
    """Whether the model's forward selects the positions its LM head runs at (transformers' `logits_to_keep`)."""
    return "logits_to_keep" in inspect.signature(type(model).forward).parameters


def assistant_nll(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor
                  ) -> tuple[torch.Tensor, float]:
    """Mean next-token negative log-likelihood over the loss-carrying positions (weighted by loss_mask), and the
    sum of the weights."""
    total, count = masked_nll_sum(model, input_ids, attention_mask, loss_mask)
    return total / (count or 1.0), count


def collate(rows: Sequence[SFTRow], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad rows into input_ids / attention_mask (long) and loss_mask (float32) tensors."""
    width = max(len(r.input_ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    loss = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        n = len(r.input_ids)
        ids[i, :n] = torch.tensor(r.input_ids)
        attention[i, :n] = 1
        loss[i, :n] = torch.tensor(r.loss_mask, dtype=torch.float32)
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss}


def batch_schedule(n_rows: int, steps: int, batch_size: int, seed: int) -> list[list[int]]:
    """Row indices of every step's batch: `min(batch_size, n_rows)` rows per step, taken epoch by epoch from an
    order shuffled by `random.Random(seed)` (an epoch boundary may fall inside a batch)."""
    rng = random.Random(seed)
    order: list[int] = []
    batches = []
    for _ in range(steps):
        batch = []
        while len(batch) < min(batch_size, n_rows):
            if not order:
                order = list(range(n_rows))
                rng.shuffle(order)
            batch.append(order.pop())
        batches.append(batch)
    return batches


@dataclass
class _Runtime:
    """Where this process trains: its rank, the world size, its device and whether it joined the process group
    itself (then it leaves it when training ends)."""

    rank: int
    world: int
    device: torch.device
    owns_group: bool = False

    @property
    def distributed(self) -> bool:
        return self.world > 1


def _runtime() -> _Runtime:
    """Join the torchrun process group when WORLD_SIZE > 1 (NCCL on CUDA, gloo on CPU); else one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    owns_group = world > 1 and not dist.is_initialized()
    if owns_group:
        if is_cuda_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=get_dist_backend())
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
    device = torch.device("cuda", torch.cuda.current_device()) if is_cuda_available() else torch.device("cpu")
    return _Runtime(rank, world, device, owns_group)


def _enable_checkpointing(model: Any) -> None:
    """Activation checkpointing through whichever method this transformers version has."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _load_model(model_path: Path, config: SFTConfig, rt: _Runtime) -> Any:
    """The model to train: FSDP2-sharded under torchrun, else loaded whole (fp32 weights) on the device."""
    from transformers import AutoModelForCausalLM

    if rt.distributed:
        from verl.utils.fsdp_utils import build_fsdp_model, create_device_mesh, unwrap_model

        mesh = create_device_mesh(rt.device.type)
        fsdp_config = {"param_dtype": config.param_dtype, "reshard_after_forward": config.reshard_after_forward}
        model = build_fsdp_model(AutoModelForCausalLM, str(model_path), mesh, fsdp_config, seed=config.seed)
        if config.gradient_checkpointing:
            _enable_checkpointing(unwrap_model(model))
        return model
    previous_rng = torch.random.get_rng_state()
    torch.manual_seed(config.seed)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    finally:
        torch.random.set_rng_state(previous_rng)
    if config.gradient_checkpointing:
        _enable_checkpointing(model)
    return model.to(rt.device)


def _compute_dtype(config: SFTConfig, rt: _Runtime) -> torch.dtype | None:
    """The autocast dtype of a single-process run (None: plain fp32)."""
    wanted = config.param_dtype if config.param_dtype != "auto" else ("bf16" if rt.device.type == "cuda" else "fp32")
    return torch.bfloat16 if wanted == "bf16" and rt.device.type == "cuda" else None


def _export(model: Any, tokenizer: Any, out: Path, config: SFTConfig, rt: _Runtime) -> None:
    """Write the trained model (HF layout) and the tokenizer to `out` on rank 0 (a collective under torchrun)."""
    dtype = EXPORT_DTYPES[config.export_dtype]
    if rt.distributed:
        from verl.utils.fsdp_utils import full_state_dict, save_hf_pretrained

        state = full_state_dict(model)
        if rt.rank == 0:
            save_hf_pretrained(model, {k: v.to(dtype) for k, v in state.items()}, out)
        dist.barrier()
    elif dtype == torch.float32:
        model.save_pretrained(out)
    else:
        model.save_pretrained(out, state_dict={k: v.to(dtype) for k, v in model.state_dict().items()})
    if rt.rank == 0:
        tokenizer.save_pretrained(out)
        weights_like_the_rest(out)


def train_sft(model_path: str | Path, rows: Sequence[SFTRow], out_dir: str | Path, config: SFTConfig,
              extra_log: Mapping[str, Any] | None = None) -> Path:
    """Fine-tune the local causal LM at `model_path` on `rows` (see the module docstring) and export it to
    `out_dir`; returns `out_dir`. `extra_log` is added to `sft_log.json`."""
    from transformers import AutoTokenizer

    from verl.utils.fsdp_utils import clip_grad_norm

    if not rows:
        raise ValueError("train_sft: no rows to train on")
    if all(sum(r.loss_mask) == 0 for r in rows):
        raise ValueError("train_sft: no row has a loss-carrying token")
    rt = _runtime()
    if config.batch_size % rt.world:
        raise ValueError(f"batch_size {config.batch_size} must be a multiple of the world size {rt.world} (every "
                         "rank runs the same number of forward passes)")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token_id is None:
        raise ValueError(f"the tokenizer at {model_path} has no pad token")
    model = _load_model(Path(model_path), config, rt)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    autocast = _compute_dtype(config, rt)
    losses: list[float] = []
    grad_norms: list[float] = []
    skipped = 0
    started = time.monotonic()
    schedule = batch_schedule(len(rows), config.steps, config.batch_size, config.seed)
    bar = tqdm(schedule, desc="sft", disable=rt.rank != 0, leave=False)
    for step, batch in enumerate(bar):
        factor = lr_factor(step, config.warmup_steps, config.steps, config.lr_schedule, config.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = config.lr * factor
        mine = [rows[i] for i in batch[rt.rank::rt.world]]
        micro = config.micro_batch_size or len(mine)
        chunks = [collate(mine[i:i + micro], tokenizer.pad_token_id) for i in range(0, len(mine), micro)]
        count = sum(float(c["loss_mask"][:, 1:].sum()) for c in chunks)
        if rt.distributed:
            totals = torch.tensor([count], dtype=torch.float64, device=rt.device)
            dist.all_reduce(totals)
            count = float(totals.item())
        scale = rt.world / (count or 1.0)
        optimizer.zero_grad(set_to_none=True)
        step_nll = torch.zeros((), dtype=torch.float64, device=rt.device)
        for chunk in chunks:
            chunk = {k: v.to(rt.device) for k, v in chunk.items()}
            with torch.autocast(rt.device.type, dtype=autocast, enabled=autocast is not None):
                total, _ = masked_nll_sum(model, chunk["input_ids"], chunk["attention_mask"], chunk["loss_mask"])
            (total * scale if rt.distributed else total / (count or 1.0)).backward()
            step_nll += total.detach().double()
        if rt.distributed:
            dist.all_reduce(step_nll)
        grad_norm = clip_grad_norm(model, config.grad_clip)
        grad_norms.append(grad_norm)
        if math.isfinite(grad_norm):
            optimizer.step()
        else:
            skipped += 1
            logger.warning("sft step %d: gradient norm %s; step skipped", step + 1, grad_norm)
        losses.append(float(step_nll.item()) / (count or 1.0))
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
        if rt.rank == 0 and (step % 20 == 0 or step == config.steps - 1):
            logger.info("sft step %d/%d loss %.4f", step + 1, config.steps, losses[-1])
    seconds = time.monotonic() - started

    out = Path(out_dir)
    if rt.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    _export(model, tokenizer, out, config, rt)
    if rt.rank == 0:
        log = {"model": str(model_path), **asdict(config), "world_size": rt.world, "n_rows": len(rows),
               "seconds": round(seconds, 3), "skipped_steps": skipped, **dict(extra_log or {}), "losses": losses,
               "grad_norms": grad_norms}
        (out / LOG_FILE).write_text(json.dumps(log) + "\n", encoding="utf-8")
        logger.info("sft: %d steps on %d rows (%d rank(s)) in %.1f s, loss %.4f -> %.4f; saved to %s",
                    config.steps, len(rows), rt.world, seconds, losses[0], losses[-1], out)
    if rt.owns_group:  # gloo's threads must not outlive the interpreter (a SIGABRT at exit otherwise)
        del model, optimizer
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    return out
