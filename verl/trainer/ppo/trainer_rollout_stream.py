"""Bounded staleness with partial dialogues (``async_training.staleness_threshold=k >= 2``, ``partial_rollout=true``).

:class:`RolloutStream` runs the steps' rollouts one after another on one background thread, up to ``depth`` (= k)
steps ahead of the trainer: after taking step N the trainer queues steps up to N + k (:func:`fill_limit`), so the
rollout thread goes on with step N+1, N+2, ... while step N trains, and a rollout's dialogues keep going across
every update that lands meanwhile (between two agent turns, as in one-step-off). Each rollout is followed, on the
same thread and before the next rollout starts, by the rollout loop's end-of-step hook (``seen``): the state
controller and the cache see the steps' outcomes in step order, never while another rollout runs. A step's prompt
batch is drawn on the main thread when it is queued, so the loader is read in step order.

Staleness: step N+k is queued after step N is taken and before it trains, so its oldest token is at least the
trainer's version of step N and at most k versions behind when step N+k trains; the drop rule
(:func:`~verl.trainer.ppo.trainer_stale_drop.drop_stale_dialogues`) guards it.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from verl.protocol import DataProto
from verl.trainer.ppo.trainer_off_policy import RolloutFn, TakenRollout

logger = logging.getLogger(__name__)

__all__ = ["RolloutStream", "fill_limit"]

SeenFn = Callable[[DataProto, int], dict[str, float]]


def fill_limit(step: int, depth: int, boundary: Callable[[int], bool]) -> int:
    """The last step whose rollout may be queued once step ``step`` is taken: up to ``step + depth``, but no rollout
    beyond a boundary step (validation, checkpoint, the last step) at or after ``step``, so nothing is in flight
    across one."""
    last = step
    while last < step + depth and not boundary(last):
        last += 1
    return last


class RolloutStream:
    """Up to ``depth`` steps' rollouts queued or running on one background thread, taken in step order; see the
    module docstring. ``rollout`` is ``StepRollouts.train_batch``, ``seen(batch, step)`` the rollout loop's
    end-of-step hook, ``generated`` (optional) the event the loops' engine sets per generation (``TurnSignal``)."""

    def __init__(self, rollout: RolloutFn, seen: SeenFn, depth: int,
                 generated: threading.Event | None = None) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._rollout, self._seen, self.depth = rollout, seen, depth
        self._generated = generated
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-stream")
        self._pending: OrderedDict[int, Future] = OrderedDict()
        self._finished_at: float | None = None  # when the last rollout ended (written by the thread)

    @property
    def queued(self) -> list[int]:
        """The steps queued or running, not taken yet, in order."""
        return list(self._pending)

    @property
    def last_queued(self) -> int | None:
        """The last step queued (None when nothing is)."""
        return next(reversed(self._pending)) if self._pending else None

    def submit(self, prompts: DataProto, step: int) -> None:
        """Queue step ``step``'s rollout; RuntimeError when ``depth`` are queued or ``step`` is not the next one."""
        last = self.last_queued
        if last is not None and step != last + 1:
            raise RuntimeError(f"step {step}'s rollout queued after step {last}'s: steps are queued in order")
        if len(self._pending) >= self.depth:
            raise RuntimeError(f"{len(self._pending)} rollouts are queued (depth {self.depth}); take step "
                               f"{next(iter(self._pending))}'s before queueing step {step}'s")
        if self._generated is not None:
            self._generated.clear()
        self._pending[step] = self._pool.submit(self._run, prompts, step)

    def wait_until_generating(self) -> float:
        """Wait until a generation has returned since the last :meth:`submit` (or every queued rollout has ended);
        returns the seconds waited (0 without a ``generated`` event or anything queued)."""
        if self._generated is None or not self._pending:
            return 0.0
        started = time.monotonic()
        while not self._generated.wait(0.01) and not all(f.done() for f in self._pending.values()):
            pass
        return time.monotonic() - started

    def _run(self, prompts: DataProto, step: int):
        started = time.monotonic()
        idle = 0.0 if self._finished_at is None else max(0.0, started - self._finished_at)
        timing: dict[str, float] = {}
        try:
            batch, metrics = self._rollout(prompts, step, timing)
            seen = self._seen(batch, step)
        finally:
            self._finished_at = time.monotonic()
        return batch, metrics, timing, seen, idle

    def take(self, step: int) -> tuple[TakenRollout, dict[str, float]]:
        """Wait for step ``step``'s rollout (the first queued) and return it with its end-of-step hook's metrics;
        the rollout's or the hook's exception is raised here."""
        if not self._pending or next(iter(self._pending)) != step:
            raise RuntimeError(f"step {step}'s rollout is not the next queued (queued: {self.queued})")
        pending = self._pending.pop(step)
        started = time.monotonic()
        batch, metrics, timing, seen, idle = pending.result()
        return TakenRollout(batch, metrics, timing, time.monotonic() - started, idle), seen

    def close(self) -> None:
        """Cancel the queued rollouts not started, wait for the running one (their results are dropped: a resumed
        run generates them again) and stop the thread."""
        for step, pending in self._pending.items():
            if pending.cancel():
                continue
            logger.warning("async_training: waiting for step %s's rollout, still queued, to end; it is not trained "
                           "on", step)
            try:
                pending.result()
            except Exception:  # noqa: BLE001 - the run is ending on another error; this one is only logged
                logger.exception("async_training: step %s's dropped rollout failed", step)
        self._pending.clear()
        self._pool.shutdown(wait=True)
