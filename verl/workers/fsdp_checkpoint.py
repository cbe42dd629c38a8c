"""Checkpoints of an FSDP-sharded model (FSDP2 or FSDP1): an HF export plus exact per-rank resume state.

Layout of ``local_path`` (written by every rank together; the trainer makes the step directory atomic):

- ``config.json``, tokenizer files and (when the HF export is asked for) ``model.safetensors``: rank 0's HF
  ``save_pretrained`` export of the full weights in the training dtype (``export_dtype``), loadable with
  ``AutoModelForCausalLM.from_pretrained`` (or the critic's class); without the export, ``python -m
  verl.model_merger`` writes it later from the sharded state;
- ``sharded_state/``: torch.distributed.checkpoint of the sharded model and optimizer state (exact restore);
- ``extra_state_rank_{r}.pt``: rank r's LR-scheduler state and torch / numpy / python RNG states (read back with
  ``torch.load(weights_only=True)``);
- ``checkpoint_manifest.json``: the SHA-256 of every file above (:mod:`verl.utils.checkpoint_manifest`), hashed by
  the ranks in parallel once all are written.

A LoRA model (:mod:`verl.utils.lora`) saves its adapter instead of the weights: ``adapter_config.json`` (always,
naming the base model path) and, as its HF export, ``adapter_model.safetensors`` (PEFT's format); ``config.json``
is the base model's; ``sharded_state/`` holds the adapter (and a value model's head) with the optimizer state, the
frozen base being reloaded from its model path. Loading checks that the checkpoint and the model agree on LoRA and
on its rank, alpha and target modules.

The coordination of a save or load (the sharded-state plan, the final barrier) runs on a gloo group with its own
timeout (``checkpoint_timeout`` of the worker config), so slow writes do not trip the training collectives'.
"""

from __future__ import annotations

import logging
import os
import random
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from verl.utils.checkpoint_manifest import hash_files, manifest_files, write_manifest
from verl.utils.fsdp_utils import (full_state_dict, load_sharded_state, save_hf_config, save_hf_pretrained,
                                   save_sharded_state)
from verl.utils.lora import (adapter_config, is_adapter_dir, peft_model_of, peft_saved_state, read_adapter_config,
                             save_adapter)

logger = logging.getLogger(__name__)


def _rng_state() -> dict[str, Any]:
    """This process's RNG states as plain tensors/lists (loadable with ``torch.load(weights_only=True)``)."""
    np_name, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": [
            np_name, torch.from_numpy(np_keys.astype(np.int64)), int(np_pos), int(np_has_gauss), float(np_cached)
        ],
        "python": [py_version, list(py_internal), py_gauss],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`_rng_state` captured."""
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class FSDPCheckpointManager:
    """Saves and restores a sharded model with its optimizer, LR scheduler, RNG states and tokenizer."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler,
        tokenizer: Any | None = None,
        export_dtype: torch.dtype = torch.float32,
        timeout_s: float = 3600.0,
        base_model_path: str | None = None,
    ):
        self.model = model
        self.lora = peft_model_of(model) is not None
        self.base_model_path = base_model_path
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.tokenizer = tokenizer
        self.export_dtype = export_dtype
        self.timeout_s = timeout_s
        self._group: dist.ProcessGroup | None = None

    def _sync_group(self) -> dist.ProcessGroup | None:
        """The gloo group (created on first use, by every rank) that carries the waits of a save or load.

        Rank 0 writes the HF export while the others wait; on a CPU group with ``timeout_s`` that wait neither
        hits the default group's (NCCL) timeout nor blocks a GPU stream. None without torch.distributed.
        """
        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
        return self._group

    @staticmethod
    def _rank() -> int:
        """This process's rank in the default process group (0 without torch.distributed)."""
        return dist.get_rank() if dist.is_initialized() else 0

    def save_checkpoint(self, local_path: str | os.PathLike, hf_model: bool = True) -> None:
        """Write the sharded model/optimizer state, this rank's extra state, the model config and tokenizer (rank 0)
        and, with ``hf_model``, rank 0's HF export of the full weights in ``export_dtype``.

        A collective: every rank must call it with the same ``local_path`` and ``hf_model``.
        """
        path = Path(local_path)
        path.mkdir(parents=True, exist_ok=True)
        if self.lora:
            self._save_adapter(path, hf_model)
        elif hf_model:
            state_dict = full_state_dict(self.model)
            if self._rank() == 0:
                save_hf_pretrained(self.model, {k: v.to(self.export_dtype) if v.is_floating_point() else v
                                                for k, v in state_dict.items()}, path)
            del state_dict
        elif self._rank() == 0:
            save_hf_config(self.model, path)
        if self._rank() == 0 and self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(path))
        group = self._sync_group()
        save_sharded_state(self.model, self.optimizer, path, process_group=group, trainable_only=self.lora)
        extra = {"lr_scheduler": self.lr_scheduler.state_dict(), "rng": _rng_state()}
        torch.save(extra, path / f"extra_state_rank_{self._rank()}.pt")
        if group is not None:
            dist.barrier(group=group)
        self._write_manifest(path, group)
        logger.info("rank %d saved checkpoint to %s", self._rank(), path)

    def _write_manifest(self, path: Path, group: dist.ProcessGroup | None) -> None:
        """Rank 0 writes ``checkpoint_manifest.json`` of ``path``; the ranks hash a share of its files each (the
        list is rank 0's, so a rank whose view of the directory lags cannot make the shares disagree)."""
        listing = [manifest_files(path) if self._rank() == 0 else None]
        world = dist.get_world_size() if group is not None else 1
        if group is not None:
            dist.broadcast_object_list(listing, src=0, group=group)
        digests = [hash_files(path, listing[0][self._rank()::world])]
        if group is not None:
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, digests[0], group=group)
            digests = gathered
        if self._rank() == 0:
            write_manifest(path, {name: digest for part in digests for name, digest in part.items()})
        if group is not None:
            dist.barrier(group=group)

    def load_checkpoint(self, local_path: str | os.PathLike) -> None:
        """Restore model, optimizer, scheduler and this rank's RNG states from ``local_path`` (a collective)."""
        path = Path(local_path)
        extra_file = path / f"extra_state_rank_{self._rank()}.pt"
        present = [extra_file.is_file()]
        group = self._sync_group()
        if group is not None:
            present = [None] * dist.get_world_size()
            dist.all_gather_object(present, extra_file.is_file(), group=group)
        if not all(present):
            missing = [rank for rank, ok in enumerate(present) if not ok]
            raise FileNotFoundError(
                f"checkpoint {path} lacks extra_state_rank_<r>.pt for ranks {missing}: it is incomplete or was "
                "saved with a different world size"
            )
        self._check_adapter(path)
        load_sharded_state(self.model, self.optimizer, path, process_group=group, trainable_only=self.lora)
        extra = torch.load(extra_file, map_location="cpu", weights_only=True)
        self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        _set_rng_state(extra["rng"])
        if group is not None:
            dist.barrier(group=group)
        logger.info("rank %d loaded checkpoint from %s", self._rank(), path)

    def _save_adapter(self, path: Path, with_weights: bool) -> None:
        """Rank 0 writes the base model's config and ``adapter_config.json``, with ``with_weights`` also the
        gathered adapter in PEFT's format (a collective then)."""
        tensors = None
        if with_weights:
            state = full_state_dict(self.model, trainable_only=True)
            tensors = peft_saved_state(self.model, state) if self._rank() == 0 else None
        if self._rank() == 0:
            save_hf_config(self.model.get_base_model(), path)
            save_adapter(path, tensors, adapter_config(self.model, self.base_model_path))

    def _check_adapter(self, path: Path) -> None:
        """Raise naming the key when the checkpoint at ``path`` and this model disagree on LoRA or its shape."""
        if is_adapter_dir(path) != self.lora:
            saved = "a LoRA adapter" if is_adapter_dir(path) else "full weights"
            raise ValueError(f"checkpoint {path} holds {saved}, but this model is "
                             f"{'a LoRA model' if self.lora else 'fully trained'}: set model.lora_rank as when it "
                             "was saved")
        if not self.lora:
            return
        saved, current = read_adapter_config(path), adapter_config(self.model)
        for key in ("r", "lora_alpha", "target_modules", "exclude_modules"):
            if _comparable(saved.get(key)) != _comparable(current.get(key)):
                raise ValueError(f"checkpoint {path} has a LoRA adapter with {key}={saved.get(key)!r}, this model "
                                 f"{current.get(key)!r}: set model.lora_rank / lora_alpha / target_modules / "
                                 "exclude_modules as when it was saved")


def _comparable(value: Any) -> Any:
    """A config value with lists as sorted tuples (PEFT stores resolved module names as a set)."""
    return tuple(sorted(value)) if isinstance(value, (list, tuple, set)) else value
