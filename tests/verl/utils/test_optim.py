"""AdamW construction and the warm-up / cosine learning-rate schedule."""

from __future__ import annotations

import math

import pytest
import torch

from verl.utils.optim import build_lr_scheduler, build_optimizer, lr_factor, resolve_warmup_steps


def _lrs(optim_cfg: dict, steps: int) -> list[float]:
    optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(2))], optim_cfg)
    scheduler = build_lr_scheduler(optimizer, optim_cfg)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_warmup_never_starts_at_zero_and_reaches_peak():
    lrs = _lrs({"lr": 1.0, "lr_warmup_steps": 4, "total_training_steps": 10}, 6)
    assert lrs == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


def test_warmup_ratio_and_cosine_decay_to_min_lr():
    cfg = {"lr": 2.0, "lr_warmup_steps": -1, "lr_warmup_steps_ratio": 0.2, "warmup_style": "cosine",
           "min_lr_ratio": 0.1, "total_training_steps": 10}  # fmt: skip
    assert resolve_warmup_steps(cfg, 10) == 2
    lrs = _lrs(cfg, 10)
    assert lrs[:3] == pytest.approx([1.0, 2.0, 2.0])
    assert lrs[-1] == pytest.approx(2.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 7 / 8))))
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))
    assert lr_factor(100, 2, 10, "cosine", 0.1) == pytest.approx(0.1)


def test_no_warmup_is_constant():
    assert _lrs({"lr": 0.5}, 3) == [0.5, 0.5, 0.5]


def test_scheduler_state_round_trips():
    cfg = {"lr": 1.0, "lr_warmup_steps": 5, "total_training_steps": 10}
    optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(2))], cfg)
    scheduler = build_lr_scheduler(optimizer, cfg)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    other_opt = build_optimizer([torch.nn.Parameter(torch.zeros(2))], cfg)
    other = build_lr_scheduler(other_opt, cfg)
    other.load_state_dict(scheduler.state_dict())
    other_opt.step()
    other.step()
    assert other.get_last_lr() == pytest.approx([5 / 5])


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"lr": 1.0, "warmup_style": "linear"}, "warmup_style"),
        ({"lr": 1.0, "warmup_style": "cosine"}, "total_training_steps"),
        ({"lr": 1.0, "min_lr_ratio": 2.0}, "min_lr_ratio"),
        ({"lr": 1.0, "lr_warmup_steps_ratio": 1.5, "total_training_steps": 4}, "lr_warmup_steps_ratio"),
        ({"lr": 1.0, "lr_warmup_steps_ratio": 0.1}, r"total_training_steps must be set \(> 0\) to use .*_ratio"),
    ],
)
def test_bad_schedules_are_rejected(cfg, message):
    optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(2))], cfg)
    with pytest.raises(ValueError, match=message):
        build_lr_scheduler(optimizer, cfg)


def test_bad_optimizer_settings_are_rejected():
    with pytest.raises(ValueError, match="betas"):
        build_optimizer([torch.nn.Parameter(torch.zeros(2))], {"lr": 1.0, "betas": [0.9]})
    with pytest.raises(ValueError, match="optim.lr"):
        build_optimizer([torch.nn.Parameter(torch.zeros(2))], {"lr": -1.0})
