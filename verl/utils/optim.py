"""AdamW construction and the warm-up learning-rate schedules used by the FSDP workers.

The schedule is stepped once per training step (one ``update_actor`` / ``update_critic`` call), like veRL,
so ``optim.total_training_steps`` counts trainer steps. Warm-up never takes a step at learning rate 0: the
factor for training step ``k`` (0-based) is ``(k + 1) / warmup_steps`` while ``k < warmup_steps``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

logger = logging.getLogger(__name__)

WARMUP_STYLES = ("constant", "cosine")


def _get(cfg: Mapping[str, Any] | Any, key: str, default: Any) -> Any:
    """Read ``key`` from a mapping or DictConfig, returning ``default`` when it is absent or null."""
    value = cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)
    return default if value is None else value


def build_optimizer(params: Iterable[torch.nn.Parameter], optim_cfg: Mapping[str, Any]) -> torch.optim.AdamW:
    """Build AdamW from an ``optim`` config block (keys ``lr``, ``weight_decay``, ``betas``, ``eps``)."""
    lr = float(_get(optim_cfg, "lr", 1e-6))
    if lr < 0:
        raise ValueError(f"optim.lr must be >= 0, got {lr}")
    betas = tuple(float(b) for b in _get(optim_cfg, "betas", (0.9, 0.999)))
    if len(betas) != 2:
        raise ValueError(f"optim.betas must have two values, got {list(betas)}")
    return torch.optim.AdamW(
        params,
        lr=lr,
        betas=betas,
        eps=float(_get(optim_cfg, "eps", 1e-8)),
        weight_decay=float(_get(optim_cfg, "weight_decay", 0.01)),
    )


def resolve_warmup_steps(optim_cfg: Mapping[str, Any], total_training_steps: int) -> int:
    """Number of warm-up steps: ``lr_warmup_steps`` when > 0, else ``lr_warmup_steps_ratio * total``."""
    steps = int(_get(optim_cfg, "lr_warmup_steps", -1))
    if steps >= 0:
        return steps
    ratio = float(_get(optim_cfg, "lr_warmup_steps_ratio", 0.0))
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"optim.lr_warmup_steps_ratio must be in [0, 1], got {ratio}")
    return int(ratio * total_training_steps)


def lr_factor(
    step: int, warmup_steps: int, total_steps: int, warmup_style: str = "constant", min_lr_ratio: float = 0.0
) -> float:
    """Multiplier of the base learning rate for training step ``step`` (0-based).

    Linear warm-up ``(step + 1) / warmup_steps`` first; afterwards 1 (``constant``) or a cosine decay from 1
    to ``min_lr_ratio`` over the remaining ``total_steps - warmup_steps`` steps (``cosine``).
    """
    if warmup_style not in WARMUP_STYLES:
        raise ValueError(f"optim.warmup_style must be one of {WARMUP_STYLES}, got {warmup_style!r}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if warmup_style == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, optim_cfg: Mapping[str, Any]) -> LambdaLR:
    """Build the warm-up (+ optional cosine) schedule described by ``optim_cfg`` on ``optimizer``.

    Keys: ``total_training_steps`` (set by the trainer; needed for cosine and for the warm-up ratio),
    ``lr_warmup_steps``, ``lr_warmup_steps_ratio``, ``warmup_style``, ``min_lr_ratio``.
    """
    total = int(_get(optim_cfg, "total_training_steps", -1))
    style = str(_get(optim_cfg, "warmup_style", "constant"))
    min_lr_ratio = float(_get(optim_cfg, "min_lr_ratio", 0.0))
    if style not in WARMUP_STYLES:
        raise ValueError(f"optim.warmup_style must be one of {WARMUP_STYLES}, got {style!r}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if style == "cosine" and total <= 0:
        raise ValueError("optim.total_training_steps must be set (> 0) for warmup_style=cosine")
    if int(_get(optim_cfg, "lr_warmup_steps", -1)) < 0 and float(_get(optim_cfg, "lr_warmup_steps_ratio", 0.0)) > 0:
        if total <= 0:
            raise ValueError("optim.total_training_steps must be set (> 0) to use optim.lr_warmup_steps_ratio")
    warmup = resolve_warmup_steps(optim_cfg, max(total, 0))
    logger.info(
        "lr schedule: style=%s warmup_steps=%d total_steps=%d min_lr_ratio=%s", style, warmup, total, min_lr_ratio
    )
    return LambdaLR(optimizer, lambda step: lr_factor(step, warmup, total, style, min_lr_ratio))
