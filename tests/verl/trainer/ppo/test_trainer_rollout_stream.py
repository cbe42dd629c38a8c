"""Bounded staleness (``staleness_threshold=k >= 2``, ``partial_rollout=true``) without Ray: the config checks, the
queue limit, the drop rule against values worked out by hand, the rollout stream's order, and the bound as a
property over random heavy-tailed simulator latencies (a fake actor that, like a Ray actor, runs one call at a time
and counts its updates)."""
from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import torch

from verl.protocol import DataProto
from verl.trainer.config_schema import ConfigError, compose_config
from verl.trainer.config_validation import load_config
from verl.trainer.ppo.trainer_off_policy import staleness_metrics, trainer_policy_version
from verl.trainer.ppo.trainer_rollout_stream import RolloutStream, fill_limit
from verl.trainer.ppo.trainer_stale_drop import drop_stale_dialogues
from verl.workers.rollout.engine import ROLLOUT_POLICY_VERSIONS

KEY = "async_training.staleness_threshold"
NEEDED = ["actor_rollout_ref.rollout.calculate_log_probs=true", "algorithm.rollout_correction.rollout_is=token"]
PARTIAL = "async_training.partial_rollout=true"


def test_staleness_two_with_partial_dialogues_loads_with_what_it_needs(paths):
    cfg = load_config(compose_config(paths + NEEDED + [KEY + "=2", PARTIAL]))
    assert cfg.async_training.staleness_threshold == 2 and cfg.async_training.partial_rollout


@pytest.mark.parametrize("overrides,message", [
    (NEEDED + [KEY + "=2"], r"staleness_threshold=2 keeps up to 2 steps' .* set async_training.partial_rollout=true"),
    (NEEDED + [KEY + "=1", PARTIAL], r"partial_rollout=true .* needs async_training.staleness_threshold >= 2, got 1"),
    ([PARTIAL], r"partial_rollout=true .* needs async_training.staleness_threshold >= 2, got 0"),
    (NEEDED + [KEY + "=3", PARTIAL, "actor_rollout_ref.rollout.name=vllm"],
     r"staleness_threshold=3 \(bounded staleness\) .* colocated vLLM engine"),
    ([KEY + "=2", PARTIAL, "algorithm.rollout_correction.rollout_is=token"],
     r"set actor_rollout_ref.rollout.calculate_log_probs=true"),
    (NEEDED + [KEY + "=2", PARTIAL, "algorithm.filter_groups.enable=true", "actor_rollout_ref.rollout.n=2"],
     r"filter_groups.enable draws further prompt batches"),
])
def test_what_is_still_refused(paths, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(compose_config(paths + overrides), check_paths=False)


IN_FLIGHT = "async_training.rollouts_in_flight"


def test_rollouts_in_flight_loads_from_one_to_the_threshold(paths):
    assert load_config(compose_config(paths)).async_training.rollouts_in_flight == 1
    for k, m in ((2, 2), (3, 2), (3, 3)):
        cfg = load_config(compose_config(paths + NEEDED + [f"{KEY}={k}", PARTIAL, f"{IN_FLIGHT}={m}"]))
        assert cfg.async_training.rollouts_in_flight == m


@pytest.mark.parametrize("overrides,message", [
    ([f"{IN_FLIGHT}=nan"], r"rollouts_in_flight must be a finite number, got nan"),
    ([f"{IN_FLIGHT}=inf"], r"rollouts_in_flight must be a finite number, got inf"),
    ([f"{IN_FLIGHT}=0"], r"rollouts_in_flight=0.0 is outside \[1, inf\)"),
    ([f"{IN_FLIGHT}=1.5"], r"rollouts_in_flight counts rollouts running at once: a whole number >= 1, got 1.5"),
    ([f"{IN_FLIGHT}=2"], r"rollouts_in_flight=2 runs rollouts queued .*staleness_threshold=0 queues none: set it "
                         r"to at least 2 \(with partial_rollout=true\)"),
    (NEEDED + [f"{KEY}=1", f"{IN_FLIGHT}=2"], r"staleness_threshold=1 queues none"),
    (NEEDED + [f"{KEY}=2", PARTIAL, f"{IN_FLIGHT}=3"], r"staleness_threshold=2 queues at most 2: set "
                                                       r"async_training.rollouts_in_flight <= 2"),
    (NEEDED + [f"{KEY}=2", PARTIAL, f"{IN_FLIGHT}=2", "algorithm.adv_estimator=remax"],
     r"rollouts_in_flight=2: algorithm.adv_estimator=remax generates a greedy baseline .* set "
     r"async_training.rollouts_in_flight=1"),
])
def test_rollouts_in_flight_refusals_name_the_key(paths, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(compose_config(paths + overrides), check_paths=False)


def test_fill_limit_stops_at_the_depth_and_at_a_boundary():
    never = lambda step: False  # noqa: E731
    assert fill_limit(5, 2, never) == 7
    assert fill_limit(5, 3, lambda step: step == 6) == 6  # step 6 ends with a checkpoint: nothing queued beyond it
    assert fill_limit(5, 3, lambda step: step == 5) == 5  # this step ends with a checkpoint: nothing queued
    # depth 1 is one-step-off's rule: the next step unless this one is a boundary
    assert [fill_limit(s, 1, lambda step: step % 3 == 0) for s in range(1, 7)] == [2, 3, 3, 5, 6, 6]


def test_fill_queues_each_next_step_up_to_the_last():
    stream = RolloutStream(lambda prompts, step, timing: (DataProto(), {}), lambda batch, step: {}, depth=3)
    try:
        stream.fill(2, DataProto, 0)  # nothing queued: from the step after 0
        assert stream.queued == [1, 2]
        stream.fill(3, DataProto, 0)  # from the step after the last queued
        assert stream.queued == [1, 2, 3]
        stream.fill(3, DataProto, 0)
        assert stream.queued == [1, 2, 3]
    finally:
        stream.close()


def _batch(mask: list[list[int]], versions: list[list[int]], uids: list[str]) -> DataProto:
    return DataProto.from_dict(tensors={"response_mask": torch.tensor(mask),
                                        ROLLOUT_POLICY_VERSIONS: torch.tensor(versions)},
                               non_tensors={"uid": np.array(uids, dtype=object)})


def test_drop_rule_by_hand():
    # trainer at version 5, threshold 2: a row is dropped when its oldest trained token is of version 2 or older
    batch = _batch(mask=[[1, 1, 0], [1, 1, 1], [0, 1, 1], [1, 1, 0], [0, 0, 0]],
                   versions=[[3, 4, -1], [2, 5, 5], [1, 3, 4], [2, 2, -1], [-1, -1, -1]],
                   uids=["a", "a", "b", "c", "c"])
    metrics = drop_stale_dialogues(batch, version=5, threshold=2)
    # row 1 (oldest 2) and row 3 (oldest 2) are dropped; row 2's version-1 token is off the loss (oldest 3): kept;
    # group c's only trained row is dropped (row 4 trains nothing) -> a whole group; group a keeps row 0
    assert metrics == {"async/dropped_stale_dialogues": 2.0, "async/dropped_stale_groups": 1.0}
    assert batch.batch["response_mask"].tolist() == [[1, 1, 0], [0, 0, 0], [0, 1, 1], [0, 0, 0], [0, 0, 0]]
    assert list(batch.non_tensor_batch["uid"]) == ["a", "a#stale1", "b", "c#stale3", "c"]
    assert staleness_metrics(batch, 5, 2)["async/staleness_max"] == 2.0  # nothing over the bound is left


def test_drop_rule_keeps_a_batch_within_the_bound_and_refuses_an_all_stale_one():
    batch = _batch([[1, 1]], [[3, 5]], ["a"])
    assert drop_stale_dialogues(batch, 5, 2) == {"async/dropped_stale_dialogues": 0.0,
                                                 "async/dropped_stale_groups": 0.0}
    assert batch.batch["response_mask"].tolist() == [[1, 1]]
    with pytest.raises(RuntimeError, match="every dialogue of the batch is more than 1 policy versions behind"):
        drop_stale_dialogues(_batch([[1, 1], [1, 0]], [[3, 5], [2, -1]], ["a", "b"]), 5, 1)


def test_stream_takes_in_order_runs_the_hook_after_each_rollout_and_reraises():
    events: list[str] = []

    def rollout(prompts, step, timing):
        events.append(f"rollout {step}")
        if step == 3:
            raise ValueError("step 3 failed")
        return DataProto(), {"step": float(step)}

    def seen(batch, step):
        events.append(f"seen {step}")
        return {"seen": float(step)}

    stream = RolloutStream(rollout, seen, depth=2)
    try:
        stream.submit(DataProto(), 1)
        with pytest.raises(RuntimeError, match="queued in order"):
            stream.submit(DataProto(), 3)
        stream.submit(DataProto(), 2)
        with pytest.raises(RuntimeError, match=r"2 rollouts are queued \(depth 2\)"):
            stream.submit(DataProto(), 3)
        with pytest.raises(RuntimeError, match=r"step 2's rollout is not the next queued \(queued: \[1, 2\]\)"):
            stream.take(2)
        taken, hook = stream.take(1)
        assert taken.metrics == {"step": 1.0} and hook == {"seen": 1.0}
        stream.submit(DataProto(), 3)
        assert stream.take(2)[1] == {"seen": 2.0}
        with pytest.raises(ValueError, match="step 3 failed"):
            stream.take(3)
        assert stream.queued == []
    finally:
        stream.close()
    assert events == ["rollout 1", "seen 1", "rollout 2", "seen 2", "rollout 3"]


def test_rollouts_in_flight_start_in_step_order_run_together_and_are_seen_in_step_order():
    """Two in flight: each rollout starts on the trainer's thread when queued; the two finish side by side (each
    waits at a barrier for the other: one after another would time out); step 2's finishes first, yet the hooks
    run on the trainer's thread in step order when each step is taken; an error is raised at its own take."""
    events: list[str] = []
    both = threading.Barrier(2, timeout=10)
    main = threading.current_thread()

    def start(prompts, step):
        assert threading.current_thread() is main
        events.append(f"start {step}")

        def finish(timing):
            if step <= 2:
                both.wait()
                if step == 1:
                    time.sleep(0.05)  # step 2's rollout ends first
            events.append(f"finish {step}")
            if step == 4:
                raise ValueError("step 4 failed")
            return DataProto(), {"step": float(step)}
        return finish

    def seen(batch, step):
        assert threading.current_thread() is main
        events.append(f"seen {step}")
        return {"seen": float(step)}

    def never(prompts, step, timing):
        raise AssertionError("several in flight: every rollout is started ahead")

    with pytest.raises(ValueError, match="in_flight must be between 1 and depth=2, got 3"):
        RolloutStream(never, seen, depth=2, start=start, in_flight=3)
    with pytest.raises(ValueError, match="need start"):
        RolloutStream(never, seen, depth=2, in_flight=2)
    stream = RolloutStream(never, seen, depth=3, start=start, in_flight=2)
    try:
        stream.submit(DataProto(), 1)
        stream.submit(DataProto(), 2)
        assert events[:2] == ["start 1", "start 2"]
        taken, hook = stream.take(1)
        assert taken.metrics == {"step": 1.0} and hook == {"seen": 1.0}
        assert events[2:] == ["finish 2", "finish 1", "seen 1"]
        stream.submit(DataProto(), 3)
        stream.submit(DataProto(), 4)
        assert stream.take(2)[1] == {"seen": 2.0} and stream.take(3)[1] == {"seen": 3.0}
        with pytest.raises(ValueError, match="step 4 failed"):
            stream.take(4)
    finally:
        stream.close()
    assert [e for e in events if e.startswith("seen")] == ["seen 1", "seen 2", "seen 3"]
    assert [e for e in events if e.startswith("start")] == ["start 1", "start 2", "start 3", "start 4"]


class SerialActor:
    """The actor worker as a Ray actor runs it: one call at a time; ``version`` counts the updates."""

    def __init__(self, rng: random.Random, update_s: tuple[float, float]) -> None:
        self.rng, self.update_s, self.lock, self.version = rng, update_s, threading.Lock(), 0

    def generate(self) -> int:
        """One generation call: the version of the weights it ran on (they cannot change during the call)."""
        with self.lock:
            version = self.version
            time.sleep(0.001)
            assert self.version == version
            return version

    def update(self) -> None:
        with self.lock:
            time.sleep(self.rng.uniform(*self.update_s))
            self.version += 1


def _dialogues(actor: SerialActor, rng: random.Random, rows: int, tokens: int, generated: threading.Event):
    """A rollout of ``rows`` dialogues, row r joining at agent turn r % 3 and talking for 1-3 turns: per turn one
    generation for the rows talking (``generated`` set when it returns, as TurnSignal does), then the simulators'
    answers, whose latency is heavy-tailed (Pareto, alpha 1.5; the slowest user of the turn holds it); each token
    keeps its turn's version."""
    def rollout(prompts: DataProto, step: int, timing: dict[str, float]):
        spans = [(r % 3, r % 3 + rng.randint(1, 3)) for r in range(rows)]
        versions = torch.full((rows, 5 * tokens), -1, dtype=torch.long)
        for turn in range(max(end for _, end in spans)):
            talking = [r for r, (start, end) in enumerate(spans) if start <= turn < end]
            if not talking:
                continue
            version = actor.generate()
            generated.set()
            versions[talking, turn * tokens:(turn + 1) * tokens] = version
            time.sleep(min(0.1, max(0.001 * rng.paretovariate(1.5) for _ in talking)))
        uids = np.array([f"s{step}_{r // 2}" for r in range(rows)], dtype=object)  # GRPO groups of two
        batch = DataProto.from_dict(
            tensors={"response_mask": (versions >= 0).long(), ROLLOUT_POLICY_VERSIONS: versions},
            non_tensors={"uid": uids})
        return batch, {}
    return rollout


def _run(seed: int, depth: int, threshold: int, steps: int = 8,
         update_s: tuple[float, float] = (0.005, 0.06),
         driver_s: tuple[float, float] = (0.0, 0.0), in_flight: int = 1) -> tuple[list[int], int, int, int]:
    """Drive the stream as ``stream_step`` does; returns each step's lag of its oldest token (computed from the
    versions, independently of the drop rule), the over-stale rows counted independently, the rows the drop rule
    dropped, and the steps refused for being all over-stale. ``driver_s``: the range of the trainer's time off the actor
    per step (advantages, metrics), during which the rollouts run ahead freely."""
    rng = random.Random(seed)
    actor = SerialActor(rng, update_s)
    generated = threading.Event()
    rollout = _dialogues(actor, rng, rows=4, tokens=2, generated=generated)
    stream = RolloutStream(rollout, lambda b, s: {}, depth, generated,
                           lambda prompts, step: lambda timing: rollout(prompts, step, timing), in_flight)
    lags, over, dropped, refused = [], 0, 0, 0
    try:
        for step in range(1, steps + 1):
            fill_to = fill_limit(step, depth, lambda s: s >= steps)
            if not stream.queued:
                stream.fill(min(fill_to, step + depth - 1), DataProto, step - 1)
            taken, _ = stream.take(step)
            stream.fill(fill_to, DataProto, step)
            if stream.queued:
                stream.wait_until_generating()
            version = trainer_policy_version(step, 0)
            assert actor.version == version  # the proximal policy is the actor's now
            batch = taken.batch
            mask = batch.batch["response_mask"].bool()
            oldest = torch.where(mask, batch.batch[ROLLOUT_POLICY_VERSIONS], version).min(dim=1).values
            lags.append(int(version - oldest.min()))
            stale = int(((version - oldest) > threshold).sum())
            over += stale
            if stale == len(batch):
                with pytest.raises(RuntimeError, match="nothing is left to train on"):
                    drop_stale_dialogues(batch, version, threshold)
                refused += 1
            else:
                dropped += int(drop_stale_dialogues(batch, version, threshold)["async/dropped_stale_dialogues"])
                trained = batch.batch[ROLLOUT_POLICY_VERSIONS][batch.batch["response_mask"].bool()]
                assert int((version - trained).max()) <= threshold  # no trained token is over the bound
                staleness_metrics(batch, version, threshold)
            time.sleep(rng.uniform(*driver_s))
            actor.update()
    finally:
        stream.close()
    return lags, over, dropped, refused


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k", [2, 3])
def test_no_trained_token_is_more_than_k_versions_behind_under_heavy_tailed_latency(seed, k):
    lags, over, dropped, refused = _run(seed, depth=k, threshold=k)
    assert lags[0] == 0 and max(lags) <= k  # queued k ahead, never more than k behind: nothing to drop
    assert (over, dropped, refused) == (0, 0, 0)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k,m", [(2, 2), (3, 2), (3, 3)])
def test_the_bound_holds_with_rollouts_in_flight_together(seed, k, m):
    lags, over, dropped, refused = _run(seed, depth=k, threshold=k, in_flight=m)
    assert lags[0] == 0 and max(lags) <= k and (over, dropped, refused) == (0, 0, 0)


@pytest.mark.parametrize("k", [2, 3])
def test_with_steps_slower_than_the_rollouts_the_queue_fills_to_exactly_k_behind(k):
    # the rollouts finish during the trainer's time off the actor, so step N+k's starts on step N's weights
    lags, over, dropped, refused = _run(0, depth=k, threshold=k, driver_s=(0.15, 0.15))
    assert lags == list(range(k + 1)) + [k] * (8 - k - 1) and (over, dropped, refused) == (0, 0, 0)


def test_every_over_stale_dialogue_is_dropped_and_counted():
    # a stream queued one step deeper than the bound, with steps slower than the rollouts, lets dialogues fall
    # behind it: the drop rule must catch each (rows joining later may stay within it and are trained)
    dropped_in_all = 0
    for seed in range(4):
        lags, over, dropped, refused = _run(seed, depth=3, threshold=2, steps=12, driver_s=(0.0, 0.05))
        assert over == dropped + 4 * refused  # every over-stale row dropped (or its all-stale step refused)
        assert max(lags) <= 3
        dropped_in_all += dropped
    assert dropped_in_all > 0


@pytest.mark.parametrize("seed", range(3))
def test_a_stream_one_deep_is_one_step_off(seed):
    # phase 1's pinned lags: step 1 has nothing to overlap, every later step's oldest tokens are one version behind
    lags, over, dropped, refused = _run(seed, depth=1, threshold=1, steps=6)
    assert lags == [0] + [1] * 5 and (over, dropped, refused) == (0, 0, 0)
