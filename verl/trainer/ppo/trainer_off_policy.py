"""One-step-off training (``async_training.staleness_threshold=1``): step N+1's rollout runs while step N trains.

:class:`RolloutAhead` runs a step's rollout (generation and reward, :meth:`StepRollouts.train_batch`) on its own
thread; the trainer's main thread takes the finished batch, starts the next step's rollout and trains on the batch
it took. The worker group serialises the two threads' calls (each rank runs one call at a time, every rank in the
same order: :class:`~verl.single_controller.ray.RayWorkerGroup`), so the weights change between two generation
calls, never inside one: an agent turn is sampled by one policy version, and a dialogue may hold turns of two.
Since the workers run one call at a time, a rollout started just before the training calls would find them busy
and wait for the whole update; so after starting it the trainer waits for its first generation to return
(:class:`TurnSignal`), and the update runs while the simulated users answer those turns.

:func:`trainer_policy_version` is the version the step trains from (the proximal policy of decoupled PPO, whose
log-probs the old-log-prob pass recomputes); :func:`staleness_metrics` checks every trained token's recorded version
against it and the threshold, and logs how far behind the tokens and dialogues are (``async/*``).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from verl.protocol import DataProto
from verl.workers.rollout.engine import ROLLOUT_POLICY_VERSIONS, RolloutEngine

logger = logging.getLogger(__name__)

__all__ = ["RolloutAhead", "TakenRollout", "TurnSignal", "staleness_metrics", "take_and_refill",
           "trainer_policy_version"]

RolloutFn = Callable[[DataProto, int, dict[str, float]], tuple[DataProto, dict[str, float]]]


def trainer_policy_version(step: int, critic_warmup: int) -> int:
    """The actor's policy version while step ``step`` (1-based) trains, before its own update: one per earlier step
    past ``trainer.critic_warmup`` (the steps that updated the actor; the workers count them the same way)."""
    return max(0, step - 1 - critic_warmup)


def staleness_metrics(batch: DataProto, version: int, threshold: int) -> dict[str, float]:
    """``async/*``: how many versions each trained token (``response_mask``) and each dialogue (row) lags the
    trainer's ``version``. RuntimeError when the batch has no per-token versions, a token is newer than ``version``
    or more than ``threshold`` behind (never trained on silently)."""
    if ROLLOUT_POLICY_VERSIONS not in batch.batch.keys():
        raise RuntimeError(f"async_training needs the policy version of every sampled token (batch key "
                           f"{ROLLOUT_POLICY_VERSIONS!r}); the rollout returned {sorted(batch.batch.keys())}")
    mask = batch.batch["response_mask"].bool()
    versions = batch.batch[ROLLOUT_POLICY_VERSIONS]
    if bool((versions[mask] < 0).any()):
        raise RuntimeError("a trained token has no recorded policy version (-1 under response_mask)")
    lag = torch.where(mask, version - versions, torch.zeros_like(versions))
    if bool((lag < 0).any()):
        raise RuntimeError(f"a token was sampled by policy version {int(versions[mask].max())}, newer than the "
                           f"trainer's {version}: the version bookkeeping is broken")
    worst = int(lag.max()) if lag.numel() else 0
    if worst > threshold:
        raise RuntimeError(f"a token is {worst} policy versions behind the trainer's {version}, more than "
                           f"async_training.staleness_threshold={threshold}")
    tokens = lag[mask].to(torch.float64)
    rows = mask.any(dim=1)
    row_lag = lag.max(dim=1).values[rows].to(torch.float64)
    oldest = torch.where(mask, versions, torch.full_like(versions, version)).min(dim=1).values
    newest = torch.where(mask, versions, torch.full_like(versions, -1)).max(dim=1).values
    mixed = (newest > oldest)[rows].to(torch.float64)
    metrics = {"async/policy_version": float(version), "async/staleness_max": float(worst)}
    if tokens.numel():
        metrics.update({"async/staleness_mean": float(tokens.mean()),
                        "async/tokens_stale_frac": float((tokens > 0).to(torch.float64).mean()),
                        "async/dialogue_staleness_mean": float(row_lag.mean()),
                        "async/dialogues_stale_frac": float((row_lag > 0).to(torch.float64).mean()),
                        "async/dialogues_mixed_versions_frac": float(mixed.mean())})
    return metrics


@dataclass(frozen=True)
class TakenRollout:
    """A finished rollout: the scored batch, its metrics and timings (``gen``, ``reward``), how long the trainer
    waited for it and, when the next rollout was started, for that one's first generation (``trainer_idle_s``), and
    how long no rollout ran before it started (``rollout_idle_s``)."""

    batch: DataProto
    metrics: dict[str, float]
    timing: dict[str, float]
    trainer_idle_s: float
    rollout_idle_s: float


def take_and_refill(ahead: RolloutAhead, step: int, next_prompts: Callable[[], DataProto],
                    seen: Callable[[DataProto], dict[str, float]],
                    overlap_next: bool) -> tuple[TakenRollout, dict[str, float]]:
    """The rollout side of a one-step-off step: take step ``step``'s rollout (started now when none is in flight),
    hand its batch to ``seen`` (the rollout loop's end-of-step hook, run while no rollout is in flight, so the state
    controller and the cache see the outcomes before the next rollout starts, as in the synchronous trainer), then
    start step ``step + 1``'s rollout when ``overlap_next``. Returns the rollout taken and ``seen``'s metrics."""
    if not ahead.in_flight:
        ahead.start(next_prompts(), step)
    taken = ahead.take(step)
    seen_metrics = seen(taken.batch)
    if overlap_next:
        ahead.start(next_prompts(), step + 1)
        waited = ahead.wait_until_generating()
        taken = dataclasses.replace(taken, trainer_idle_s=taken.trainer_idle_s + waited)
    return taken, seen_metrics


class TurnSignal(RolloutEngine):
    """The rollout loops' engine in one-step-off training: ``engine`` (and its replicas, each wrapped), with
    ``generated``, an event set whenever one of their generations returns."""

    def __init__(self, engine: RolloutEngine, generated: threading.Event | None = None) -> None:
        self.engine = engine
        self.world_size = engine.world_size
        self.generated = generated if generated is not None else threading.Event()

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """The wrapped engine's generation; sets ``generated`` when it returns."""
        out = self.engine.generate_sequences(prompts)
        self.generated.set()
        return out

    def replicas(self) -> list[RolloutEngine]:
        """The wrapped engine's replicas, each signalling ``generated``."""
        return [TurnSignal(replica, self.generated) for replica in self.engine.replicas()]

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def close(self) -> None:
        self.engine.close()


class RolloutAhead:
    """At most one step's rollout in flight on a background thread; see the module docstring.

    ``rollout(prompts, step, timing)`` returns the step's scored batch and its metrics (``StepRollouts.train_batch``);
    ``generated`` (optional) is set by the rollout's engine each time a generation returns (:class:`TurnSignal`).
    """

    def __init__(self, rollout: RolloutFn, generated: threading.Event | None = None) -> None:
        self._rollout = rollout
        self._generated = generated
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-ahead")
        self._pending: Future | None = None
        self._step: int | None = None
        self._idle_s = 0.0
        self._finished_at: float | None = None  # when the last rollout ended (written by its thread)

    @property
    def in_flight(self) -> bool:
        """Whether a rollout was started and not taken yet."""
        return self._pending is not None

    def start(self, prompts: DataProto, step: int) -> None:
        """Start step ``step``'s rollout of ``prompts``; RuntimeError when one is already in flight."""
        if self._pending is not None:
            raise RuntimeError(f"step {self._step}'s rollout is still in flight; take it before starting step {step}'s")
        now = time.monotonic()
        self._idle_s = 0.0 if self._finished_at is None else now - self._finished_at
        self._step = step
        if self._generated is not None:
            self._generated.clear()
        self._pending = self._pool.submit(self._run, prompts, step)

    def wait_until_generating(self) -> float:
        """Wait until the rollout in flight has had a generation returned (or has ended); returns the seconds
        waited (0 without a ``generated`` event or a rollout in flight)."""
        if self._generated is None or self._pending is None:
            return 0.0
        started = time.monotonic()
        while not self._generated.wait(0.01) and not self._pending.done():
            pass
        return time.monotonic() - started

    def _run(self, prompts: DataProto, step: int) -> tuple[DataProto, dict[str, float], dict[str, float]]:
        timing: dict[str, float] = {}
        try:
            batch, metrics = self._rollout(prompts, step, timing)
        finally:
            self._finished_at = time.monotonic()
        return batch, metrics, timing

    def take(self, step: int) -> TakenRollout:
        """Wait for step ``step``'s rollout and return it (its thread's exception is raised here)."""
        if self._pending is None or self._step != step:
            raise RuntimeError(f"no rollout of step {step} is in flight (in flight: step {self._step})")
        pending, self._pending = self._pending, None
        started = time.monotonic()
        batch, metrics, timing = pending.result()
        return TakenRollout(batch, metrics, timing, time.monotonic() - started, self._idle_s)

    def close(self) -> None:
        """Wait for a rollout still in flight (its result is dropped: a resumed run generates it again) and stop
        the thread."""
        if self._pending is not None:
            logger.warning("async_training: waiting for step %s's rollout, still in flight, to end; it is not "
                           "trained on", self._step)
            try:
                self._pending.result()
            except Exception:  # noqa: BLE001 - the run is ending on another error; this one is only logged
                logger.exception("async_training: step %s's dropped rollout failed", self._step)
            self._pending = None
        self._pool.shutdown(wait=True)
