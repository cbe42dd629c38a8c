"""Per-micro-batch metrics kept on the device and copied to the host once per mini-batch.

Reading a device tensor (``.item()``) waits for every kernel queued before it; doing so per micro-batch stalls
the GPU between micro-batches. The buffer keeps the detached tensors and turns them into floats with a single
transfer when the mini-batch is done (after the optimizer step, which synchronises anyway).
"""

from __future__ import annotations

from typing import Any

import torch


class MetricBuffer:
    """Collects ``{name: value}`` dicts (0-d tensors or numbers) and appends them to a metrics dict in order."""

    def __init__(self) -> None:
        self._pending: list[tuple[str, Any]] = []

    def add(self, values: dict[str, Any]) -> None:
        """Queue ``values``; tensors are detached and stay where they are."""
        for name, value in values.items():
            self._pending.append((name, value.detach() if isinstance(value, torch.Tensor) else float(value)))

    def flush_into(self, metrics: dict[str, list[float]]) -> None:
        """Append every queued value (as a float) to ``metrics[name]``, reading all tensors in one transfer."""
        tensors = [value.reshape(()).to(torch.float64) for _, value in self._pending if isinstance(value, torch.Tensor)]
        host = iter(torch.stack(tensors).tolist() if tensors else [])
        for name, value in self._pending:
            metrics.setdefault(name, []).append(next(host) if isinstance(value, torch.Tensor) else value)
        self._pending.clear()
