"""How a rollout spent its time: busy fractions and in-flight counts of the policy engine and the simulator,
and the dialogues' durations, for the sync and the async loop alike.

A `BusyMeter` integrates an in-flight count over time: the share of the wall time with at least one unit in
flight (busy fraction), the time-weighted mean and the peak of the count. `pacing_metrics` turns the meters and
the dialogues' end times into the step's `rollout/*` pacing metrics.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["BusyMeter", "pacing_metrics"]


class BusyMeter:
    """The in-flight count of one kind of work over time (e.g. rows being generated, simulator requests)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last = clock()
        self._count = 0
        self.busy_s = 0.0  # seconds with at least one unit in flight
        self.area = 0.0  # integral of the count over time (unit-seconds)
        self.peak = 0
        self.started = 0  # units begun
        self.calls = 0  # begin() calls (e.g. generation batches)

    def _advance(self) -> None:
        now = self._clock()
        if self._count > 0:
            self.busy_s += now - self._last
            self.area += self._count * (now - self._last)
        self._last = now

    def begin(self, units: int = 1) -> None:
        """`units` more are in flight from now."""
        self._advance()
        self._count += units
        self.started += units
        self.calls += 1
        self.peak = max(self.peak, self._count)

    def end(self, units: int = 1) -> None:
        """`units` fewer are in flight from now."""
        self._advance()
        if units > self._count:
            raise RuntimeError(f"BusyMeter.end({units}) with only {self._count} in flight")
        self._count -= units

    def settle(self) -> None:
        """Account the time up to now (call before reading the totals)."""
        self._advance()


def pacing_metrics(wall_s: float, engines: Sequence[BusyMeter], sim: BusyMeter,
                   durations_s: Sequence[float]) -> dict[str, float]:
    """The step's pacing metrics: per-engine busy fraction (mean over replicas), simulator busy fraction,
    time-weighted mean and peak in-flight counts, generation batches, time to the last dialogue's end and p50/p95
    of the dialogues' durations."""
    for meter in (*engines, sim):
        meter.settle()
    wall = max(wall_s, 1e-9)
    durations = np.asarray(durations_s, dtype=np.float64) if len(durations_s) else np.zeros(1)
    return {
        "rollout/time_to_last_dialogue_s": float(wall_s),
        "rollout/generate_busy_fraction": float(np.mean([m.busy_s for m in engines]) / wall) if engines else 0.0,
        "rollout/user_sim_busy_fraction": sim.busy_s / wall,
        "rollout/generate_in_flight_mean": sum(m.area for m in engines) / wall,
        "rollout/generate_in_flight_max": float(sum(m.peak for m in engines)),
        "rollout/generate_batches": float(sum(m.calls for m in engines)),
        "rollout/user_sim_in_flight_mean": sim.area / wall,
        "rollout/user_sim_in_flight_max": float(sim.peak),
        "rollout/dialogue_time_p50_s": float(np.percentile(durations, 50)),
        "rollout/dialogue_time_p95_s": float(np.percentile(durations, 95)),
    }
