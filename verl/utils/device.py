"""Device selection: one place that decides between CUDA and CPU for workers, tensors and torch.distributed."""

from __future__ import annotations

from types import ModuleType

import torch


def is_cuda_available() -> bool:
    """True when a CUDA device can be used by this process."""
    return torch.cuda.is_available()


def get_device_name() -> str:
    """The torch device type to place models and tensors on: "cuda" when available, else "cpu"."""
    return "cuda" if is_cuda_available() else "cpu"


def get_nccl_backend() -> str:
    """veRL's name for `get_dist_backend()`: the collective backend of this device ("nccl" on CUDA, "gloo" on CPU)."""
    return get_dist_backend()


def get_dist_backend() -> str:
    """The torch.distributed backend matching `get_device_name()`: "nccl" on CUDA, "gloo" on CPU."""
    return "nccl" if is_cuda_available() else "gloo"


def get_torch_device() -> ModuleType:
    """The torch device module for `get_device_name()`: `torch.cuda` or `torch.cpu` (which lacks e.g. manual_seed)."""
    return torch.cuda if is_cuda_available() else torch.cpu


def get_device_id() -> int:
    """Index of the current device: `torch.cuda.current_device()` on CUDA, 0 on CPU."""
    return torch.cuda.current_device() if is_cuda_available() else 0


def empty_cache() -> None:
    """Return the caching allocator's unused blocks to the device (``torch.cuda.empty_cache``); no-op on CPU.

    Called at the end of every worker phase: actor and critic are separate processes sharing a GPU, and one
    process cannot reuse blocks the other's allocator keeps cached after its peak.
    """
    if is_cuda_available():
        torch.cuda.empty_cache()
