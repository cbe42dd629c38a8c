"""The actor worker of ``bench/train_step.py``: everything that touches the device is read here, in the worker
process, so the bench's driver never opens a CUDA context (which would hold ~0.5 GiB of GPU 0 and, on one
GPU, share it with rank 0).

The worker times its own ``update_actor`` and ``compute_log_prob`` calls between two
``torch.cuda.synchronize()`` (the kernels of the timed call have finished, none of an earlier one is counted) and
reports, per rank, the peak allocated and reserved CUDA memory since the last ``reset_measurements`` (on CPU:
the process's peak resident set size, which cannot be reset).
"""
from __future__ import annotations

import os
import platform
import resource
import time
from collections import defaultdict
from typing import Any, Callable

import torch

from verl.protocol import DataProto
from verl.single_controller.base import Dispatch, register
from verl.workers.fsdp_workers import ActorRolloutRefWorker

MIB = 2**20


def _synchronize() -> None:
    """Wait for this process's CUDA kernels (no-op on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class BenchActorWorker(ActorRolloutRefWorker):
    """The actor worker plus in-worker device information, synchronised timings and peak memory."""

    def __init__(self, config, role: str):
        super().__init__(config, role)
        self._seconds: dict[str, list[float]] = defaultdict(list)

    def _timed(self, name: str, call: Callable[[DataProto], DataProto], data: DataProto) -> DataProto:
        """Run ``call(data)`` between two device synchronisations and record its seconds under ``name``."""
        _synchronize()
        start = time.perf_counter()
        output = call(data)
        _synchronize()
        self._seconds[name].append(time.perf_counter() - start)
        return output

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_actor(self, data: DataProto) -> DataProto:
        """:meth:`ActorRolloutRefWorker.update_actor`, timed."""
        return self._timed("update_actor", super().update_actor, data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """:meth:`ActorRolloutRefWorker.compute_log_prob`, timed."""
        return self._timed("compute_log_prob", super().compute_log_prob, data)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def device_info(self) -> dict[str, Any]:
        """This rank's process id, device name and memory, torch/CUDA versions and the attention kernel in use."""
        info: dict[str, Any] = {"rank": self.rank, "pid": os.getpid(), "torch": torch.__version__,
                                "cuda": torch.cuda.is_available(),
                                "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            info.update(name=props.name, total_memory_mib=props.total_memory / MIB,
                        capability=f"{props.major}.{props.minor}", cuda_version=torch.version.cuda)
        else:
            info["name"] = platform.processor() or platform.machine() or "cpu"
        if self._module is not None:
            info["attn_implementation"] = getattr(self._module.config, "_attn_implementation", None)
        return info

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def reset_measurements(self) -> None:
        """Forget the recorded timings and start the CUDA peak-memory counters afresh."""
        self._seconds.clear()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def measurements(self) -> dict[str, Any]:
        """Timings (seconds per call, by method) and peak memory (MiB) since the last ``reset_measurements``."""
        result: dict[str, Any] = {"rank": self.rank, "seconds": dict(self._seconds),
                                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        if torch.cuda.is_available():
            result["max_allocated_mib"] = torch.cuda.max_memory_allocated() / MIB
            result["max_reserved_mib"] = torch.cuda.max_memory_reserved() / MIB
        return result
