"""The CUDA caching allocator's settings (``PYTORCH_CUDA_ALLOC_CONF``), switched off one option at a time.

Training runs with ``expandable_segments:True`` (scripts/main.sh sets it for the trainer: less fragmentation
when sequence lengths vary between micro-batches), but vLLM's sleep mode allocates its weights and KV cache in a
memory pool of its own that expandable segments break (pytorch/pytorch#147851): older vLLM releases refuse to
start when the variable holds it, newer ones switch it off around their pool. :func:`expandable_segments_off`
switches it off, in the environment and in the live allocator, for the duration of a block (building the engine,
waking it), and restores both afterwards. Every other option of the setting is kept: torch parses the string as
a whole and resets any option it does not name.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)

# torch reads the first of these that is set (PYTORCH_ALLOC_CONF is the device-generic name of torch >= 2.9).
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
EXPANDABLE_SEGMENTS = "expandable_segments"


def allocator_conf(environ: dict[str, str] | None = None) -> tuple[str | None, str]:
    """The variable the allocator settings come from and its value: ``(None, "")`` when none is set."""
    env = os.environ if environ is None else environ
    for name in ALLOC_CONF_VARS:
        if env.get(name):
            return name, env[name]
    return None, ""


def option_enabled(conf: str, key: str) -> bool:
    """Whether ``key:True`` (or ``key:1``) is in the comma-separated allocator settings ``conf``."""
    for item in conf.split(","):
        name, _, value = item.partition(":")
        if name.strip() == key:
            return value.strip().lower() in ("true", "1")
    return False


def with_option(conf: str, key: str, enabled: bool) -> str:
    """``conf`` with ``key`` set to ``enabled`` and every other option unchanged (appended when absent)."""
    setting = f"{key}:{'True' if enabled else 'False'}"
    items = [item.strip() for item in conf.split(",") if item.strip()]
    for i, item in enumerate(items):
        if item.partition(":")[0].strip() == key:
            items[i] = setting
            return ",".join(items)
    return ",".join([*items, setting])


def _apply_live(conf: str) -> None:
    """Hand the whole settings string to this process's caching allocator (torch >= 2.9 names the setter
    ``torch._C._accelerator_setAllocatorSettings``; earlier releases, and 2.13 as a deprecated alias,
    ``torch.cuda.memory._set_allocator_settings``)."""
    setter = (getattr(torch._C, "_accelerator_setAllocatorSettings", None)
              or getattr(torch.cuda.memory, "_set_allocator_settings", None))
    if setter is None:
        raise RuntimeError("this torch cannot change the CUDA allocator's settings at run time; unset "
                           "expandable_segments in PYTORCH_CUDA_ALLOC_CONF to use vLLM's sleep mode")
    setter(conf)


@contextlib.contextmanager
def expandable_segments_off(device_type: str) -> Iterator[None]:
    """Within the block, expandable segments are off (environment and live allocator); restored on exit.

    A no-op off CUDA or when the settings do not enable expandable segments.
    """
    name, conf = allocator_conf()
    if device_type != "cuda" or name is None or not option_enabled(conf, EXPANDABLE_SEGMENTS):
        yield
        return
    off = with_option(conf, EXPANDABLE_SEGMENTS, False)
    os.environ[name] = off
    _apply_live(off)
    try:
        yield
    finally:
        os.environ[name] = conf
        _apply_live(conf)
