"""Bounded staleness with partial dialogues (``async_training.staleness_threshold=k >= 2``, ``partial_rollout=true``).

:class:`RolloutStream` runs the steps' rollouts one after another on one background thread, up to ``depth`` (= k)
steps ahead of the trainer: after taking step N the trainer queues steps up to N + k (:func:`fill_limit`), so the
rollout thread goes on with step N+1, N+2, ... while step N trains, and a rollout's dialogues keep going across
every update that lands meanwhile (between two agent turns, as in one-step-off). Each rollout is followed, on the
same thread and before the next rollout starts, by the rollout loop's end-of-step hook (``seen``): the state
controller and the cache see the steps' outcomes in step order, never while another rollout runs. A step's prompt
batch is drawn on the main thread when it is queued, so the loader is read in step order.

With ``in_flight = m > 1`` (``async_training.rollouts_in_flight``) up to m of the queued rollouts run at once, on m
threads: each is *started* on the trainer's thread when it is queued (``start(prompts, step)``,
``StepRollouts.start_train_batch``: the users drawn from the controller, the seeds, the call count, in step order)
and *finished* on a rollout thread (its dialogues and reward), beside the others; the end-of-step hook runs on the
trainer's thread when the step is taken, in step order. So the controller has seen the outcomes of every step
taken before a rollout is queued, not those of the (up to k - 1) rollouts queued before it and not yet taken. On a
latency-bound rollout (the dialogues mostly wait for simulated users) m rollouts in flight wait side by side.

Staleness: step N+k is queued after step N is taken and before it trains, so its oldest token is at least the
trainer's version of step N and at most k versions behind when step N+k trains, however many run at once; when
nothing is queued (the first step, or after a boundary) the steps up to N+k-1 are queued before step N is taken,
within the same bound. The drop rule (:func:`~verl.trainer.ppo.trainer_stale_drop.drop_stale_dialogues`) guards it.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from verl.protocol import DataProto
from verl.trainer.config_schema import ConfigError
from verl.trainer.ppo.plugins import RolloutLoop
from verl.trainer.ppo.trainer_off_policy import RolloutFn, TakenRollout

logger = logging.getLogger(__name__)

__all__ = ["RolloutStream", "check_starts_ahead", "fill_limit"]

SeenFn = Callable[[DataProto, int], dict[str, float]]
FinishFn = Callable[[dict[str, float]], tuple[DataProto, dict[str, float]]]
StartFn = Callable[[DataProto, int], FinishFn]


def check_starts_ahead(loop_cls: type[RolloutLoop], in_flight: int) -> None:
    """ConfigError when ``in_flight`` rollouts should run at once but ``loop_cls`` runs one at a time (it does not
    implement ``start_llm_loop``)."""
    if in_flight > 1 and loop_cls.start_llm_loop is RolloutLoop.start_llm_loop:
        raise ConfigError(f"async_training.rollouts_in_flight={in_flight}: the rollout loop {loop_cls.__name__} runs "
                          "one rollout at a time (it does not implement start_llm_loop): set "
                          "async_training.rollouts_in_flight=1")


def fill_limit(step: int, depth: int, boundary: Callable[[int], bool]) -> int:
    """The last step whose rollout may be queued once step ``step`` is taken: up to ``step + depth``, but no rollout
    beyond a boundary step (the trainer's: a checkpoint or the last step; not a validation, across which the queued
    rollouts keep going) at or after ``step``, so nothing is in flight across one."""
    last = step
    while last < step + depth and not boundary(last):
        last += 1
    return last


class RolloutStream:
    """Up to ``depth`` steps' rollouts queued or running, ``in_flight`` of them at once (one after another by
    default), taken in step order; see the module docstring. ``rollout`` is ``StepRollouts.train_batch``, ``seen(batch,
    step)`` the rollout loop's end-of-step hook, ``generated`` (optional) the event the loops' engine sets per
    generation (``TurnSignal``), ``start`` (required when ``in_flight > 1``) ``StepRollouts.start_train_batch``."""

    def __init__(self, rollout: RolloutFn, seen: SeenFn, depth: int,
                 generated: threading.Event | None = None, start: StartFn | None = None, in_flight: int = 1) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        if not 1 <= in_flight <= depth:
            raise ValueError(f"in_flight must be between 1 and depth={depth}, got {in_flight}")
        if in_flight > 1 and start is None:
            raise ValueError("several rollouts in flight need start (StepRollouts.start_train_batch)")
        self._rollout, self._seen, self.depth, self.in_flight = rollout, seen, depth, in_flight
        self._start, self._generated = start, generated
        self._pool = ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="rollout-stream")
        self._pending: OrderedDict[int, Future] = OrderedDict()
        self._running = 0  # rollouts running now (written by the rollout threads, under _lock)
        self._lock = threading.Lock()
        self._finished_at: float | None = None  # when the last rollout ended with none left running

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
        if self.in_flight == 1:
            self._pending[step] = self._pool.submit(self._run, prompts, step)
        else:
            finish = self._start(prompts, step)
            self._pending[step] = self._pool.submit(self._timed, lambda timing: (*finish(timing), None))

    def fill(self, last: int, prompts: Callable[[], DataProto], after: int) -> None:
        """Queue every step after the last queued (after step ``after`` when none is) up to ``last``, each with the
        next prompt batch of ``prompts``, in step order."""
        while (self.last_queued or after) < last:
            self.submit(prompts(), (self.last_queued or after) + 1)

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
        """One rollout and its end-of-step hook (one rollout at a time)."""
        def rollout_and_hook(timing: dict[str, float]):
            batch, metrics = self._rollout(prompts, step, timing)
            return batch, metrics, self._seen(batch, step)
        return self._timed(rollout_and_hook)

    def _timed(self, run: Callable[[dict[str, float]], tuple]):
        """``run(timing)``'s batch, metrics and hook metrics, with the timing and how long no rollout was running
        before this one started."""
        with self._lock:
            idle = 0.0 if self._running or self._finished_at is None else max(0.0, time.monotonic() - self._finished_at)
            self._running += 1
        timing: dict[str, float] = {}
        try:
            batch, metrics, seen = run(timing)
        finally:
            with self._lock:
                self._running -= 1
                if not self._running:
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
        waited = time.monotonic() - started
        if seen is None:  # several in flight: the hook runs here, in step order
            seen = self._seen(batch, step)
        return TakenRollout(batch, metrics, timing, waited, idle), seen

    def close(self) -> None:
        """Cancel the queued rollouts not started, wait for the running ones (their results are dropped: a resumed
        run generates them again) and stop the threads."""
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
