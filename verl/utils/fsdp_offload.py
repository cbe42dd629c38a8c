"""CPU offload of an FSDP module's parameters and its optimizer state between worker calls (veRL's
``fsdp_config.param_offload`` / ``optimizer_offload``).

With ``param_offload`` the module's (sharded) parameters live in CPU memory and are brought to the GPU only for
the duration of a call that computes with them (generation, log-probs, update, checkpointing); with
``optimizer_offload`` the optimizer state does the same around the update. Gradients need no move: they exist
only inside an update and are freed (``zero_grad(set_to_none=True)``) after the step. This is veRL's
"explicit move around the call" offload; the update itself runs on the GPU, so its result is unchanged.

On a CPU-only machine the parameters already are in CPU memory: the keys are accepted, do nothing, and say so
once per process.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

logger = logging.getLogger(__name__)

_ANNOUNCED: set[str] = set()


def _announce_once(key: str, message: str, *args: object) -> None:
    """Log ``message`` at INFO the first time ``key`` is seen in this process."""
    if key not in _ANNOUNCED:
        _ANNOUNCED.add(key)
        logger.info(message, *args)


@torch.no_grad()
def move_module(module: torch.nn.Module, device: torch.device) -> None:
    """Move an FSDP2 or FSDP1 module's parameter shards and buffers to ``device`` in place."""
    if isinstance(module, FSDP):
        for handle_module in FSDP.fsdp_modules(module):
            handle = handle_module._handle
            if handle is None:
                continue
            flat_param = handle.flat_param
            flat_param.data = flat_param.data.to(device, non_blocking=True)
            flat_param._local_shard = flat_param.data
        for buffer in module.buffers():
            buffer.data = buffer.data.to(device, non_blocking=True)
    else:
        module.to(device)


@torch.no_grad()
def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Move every tensor of the optimizer's state (e.g. AdamW moments) to ``device`` in place."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = value.to(device, non_blocking=True)


class FSDPOffloader:
    """Keeps a module's parameters and/or its optimizer's state in CPU memory outside :meth:`on_device`.

    ``where`` names the config block (e.g. ``actor_rollout_ref.actor.fsdp_config``) in log lines. Offloading is
    active only when the module's parameters are on a CUDA device at construction.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        param_offload: bool,
        optimizer_offload: bool,
        where: str,
    ):
        self.module = module
        self.optimizer = optimizer
        self.device = next(module.parameters()).device
        requested = bool(param_offload) or (bool(optimizer_offload) and optimizer is not None)
        self.active = requested and self.device.type == "cuda"
        self.param_offload = bool(param_offload) and self.active
        self.optimizer_offload = bool(optimizer_offload) and optimizer is not None and self.active
        if requested and not self.active:
            _announce_once(
                where, "%s: param_offload/optimizer_offload have no effect on %s (parameters and optimizer state "
                "already live in CPU memory)", where, self.device.type,
            )  # fmt: skip
        elif self.active:
            logger.info("%s: param_offload=%s optimizer_offload=%s", where, self.param_offload, self.optimizer_offload)

    def offload(self) -> None:
        """Move what is configured to CPU memory now (e.g. right after the model is built)."""
        if self.param_offload:
            move_module(self.module, torch.device("cpu"))
        if self.optimizer_offload:
            move_optimizer_state(self.optimizer, torch.device("cpu"))
        if self.active:
            torch.cuda.empty_cache()

    @contextlib.contextmanager
    def on_device(self, with_optimizer: bool = False) -> Iterator[None]:
        """Parameters (and, with ``with_optimizer``, the optimizer state) on the GPU inside the block, offloaded
        again after it (also when it raises)."""
        if not self.active:
            yield
            return
        if self.param_offload:
            move_module(self.module, self.device)
        if with_optimizer and self.optimizer_offload:
            move_optimizer_state(self.optimizer, self.device)
        try:
            yield
        finally:
            self.offload()
