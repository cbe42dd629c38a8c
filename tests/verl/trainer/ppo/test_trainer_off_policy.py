"""The one-step-off pieces without Ray: the ``async_training`` config checks, the staleness metrics against values
worked out by hand, the rollout-ahead thread, and the staleness bound as a property over random heavy-tailed
simulator latencies (a fake actor that, like a Ray actor, runs one call at a time and counts its updates)."""
from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from llm_agent.envs.base import TokenBuffer
from verl.protocol import DataProto
from verl.trainer.config_schema import ConfigError, compose_config
from verl.trainer.config_validation import load_config
from verl.trainer.ppo.trainer_off_policy import (RolloutAhead, TurnSignal, staleness_metrics, take_and_refill,
                                                 trainer_policy_version)
from verl.trainer.ppo.plugins import SingleTurnRollout
from verl.trainer.ppo.trainer_rollout import StepRollouts
from verl.workers.rollout.engine import ROLLOUT_POLICY_VERSIONS, RolloutEngine

KEY = "async_training.staleness_threshold"
NEEDED = [KEY + "=1", "actor_rollout_ref.rollout.calculate_log_probs=true",
          "algorithm.rollout_correction.rollout_is=token"]


def test_default_is_synchronous_and_one_step_off_loads_with_what_it_needs(paths):
    assert load_config(compose_config(paths)).async_training.staleness_threshold == 0
    assert load_config(compose_config(paths + NEEDED)).async_training.staleness_threshold == 1
    bypass = [o for o in NEEDED if "rollout_is" not in o] + ["algorithm.rollout_correction.bypass_mode=true"]
    assert load_config(compose_config(paths + bypass)).algorithm.rollout_correction.bypass_mode


@pytest.mark.parametrize("overrides,message", [
    ([KEY + "=nan"], r"async_training.staleness_threshold must be a finite number, got nan"),
    ([KEY + "=inf"], r"async_training.staleness_threshold must be a finite number, got inf"),
    ([KEY + "=-1"], r"async_training.staleness_threshold=-1.0 is outside \[0, inf\)"),
    ([KEY + "=0.5"], r"async_training.staleness_threshold counts policy versions: a whole number"),
    ([KEY + "=2"], r"async_training.staleness_threshold=2: values above 1 need partial dialogues"),
    (["async_training.partial_rollout=true"], r"async_training.partial_rollout=true .* is not built yet"),
    ([KEY + "=true"], r"async_training.staleness_threshold must be a number"),
    (NEEDED + ["actor_rollout_ref.rollout.name=vllm"], r"colocated vLLM engine .* sleeps during every training"),
    ([o for o in NEEDED if "calculate" not in o], r"set actor_rollout_ref.rollout.calculate_log_probs=true"),
    ([o for o in NEEDED if "rollout_is" not in o], r"rollout_is=token\|turn\|sequence .* or .*bypass_mode=true"),
    (NEEDED + ["algorithm.filter_groups.enable=true", "actor_rollout_ref.rollout.n=2"],
     r"filter_groups.enable draws further prompt batches"),
])
def test_refusals_name_the_key(paths, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(compose_config(paths + overrides), check_paths=False)


def _batch(mask: list[list[int]], versions: list[list[int]]) -> DataProto:
    return DataProto.from_dict(tensors={"response_mask": torch.tensor(mask),
                                        ROLLOUT_POLICY_VERSIONS: torch.tensor(versions)})


def test_staleness_metrics_by_hand():
    # trainer at version 4; row 0: two tokens of version 3 then two of 4; row 1: three of 4; row 2: no loss token
    batch = _batch([[1, 1, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0], [0] * 6],
                   [[3, 3, -1, 4, 4, -1], [4, 4, 4, -1, -1, -1], [-1] * 6])
    m = staleness_metrics(batch, version=4, threshold=1)
    assert m["async/policy_version"] == 4 and m["async/staleness_max"] == 1
    assert m["async/staleness_mean"] == pytest.approx(2 / 7) and m["async/tokens_stale_frac"] == pytest.approx(2 / 7)
    assert m["async/dialogue_staleness_mean"] == 0.5 and m["async/dialogues_stale_frac"] == 0.5
    assert m["async/dialogues_mixed_versions_frac"] == 0.5


@pytest.mark.parametrize("versions,message", [
    ([[2, 4, 4]], r"2 policy versions behind the trainer's 4, more than async_training.staleness_threshold=1"),
    ([[5, 4, 4]], r"sampled by policy version 5, newer than the trainer's 4"),
    ([[-1, 4, 4]], r"no recorded policy version"),
])
def test_staleness_metrics_refuse_what_must_not_be_trained(versions, message):
    with pytest.raises(RuntimeError, match=message):
        staleness_metrics(_batch([[1, 1, 1]], versions), version=4, threshold=1)
    with pytest.raises(RuntimeError, match="needs the policy version of every sampled token"):
        staleness_metrics(DataProto.from_dict(tensors={"response_mask": torch.ones(1, 3)}), version=4, threshold=1)


def test_trainer_policy_version_counts_the_updates_before_the_step():
    assert [trainer_policy_version(s, 0) for s in (1, 2, 3)] == [0, 1, 2]
    assert [trainer_policy_version(s, 2) for s in (1, 2, 3, 4)] == [0, 0, 0, 1]  # steps 1, 2 only train the critic


def test_token_buffer_records_each_sampled_tokens_policy_version():
    ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    buf = TokenBuffer(ids, (ids != 0).long(), 6, 0)
    buf.append_sampled(0, [1, 2], 0, policy_version=3)
    buf.append_context(0, [9])
    buf.append_sampled(0, [4], 1, policy_version=4)
    buf.append_sampled(1, [1, 2], 0, policy_version=4)
    with pytest.raises(ValueError, match="policy version -2 is negative"):
        buf.append_sampled(1, [3], 1, policy_version=-2)
    out = buf.final_tensors()
    assert out[ROLLOUT_POLICY_VERSIONS].tolist() == [[3, 3, -1, 4, -1, -1], [4, 4, -1, -1, -1, -1]]
    buf.drop_loss(1)
    assert buf.final_tensors()[ROLLOUT_POLICY_VERSIONS][1].tolist() == [-1] * 6
    buf.append_sampled(1, [3], 1)  # a turn without its version (an environment that does not pass it on)
    assert ROLLOUT_POLICY_VERSIONS not in buf.final_tensors()
    assert ROLLOUT_POLICY_VERSIONS not in TokenBuffer(ids, (ids != 0).long(), 6, 0).final_tensors()


class VersionedEngine(RolloutEngine):
    """Single-turn generation of two tokens per row (the second row stops after one), at policy version 7."""

    policy_version = 7

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        ids = prompts.batch["input_ids"]
        responses = torch.tensor([[5, 6], [5, 0]]).repeat(len(ids) // 2, 1)
        mask = (responses != 0).long()
        return self.versioned(DataProto.from_dict(tensors={
            "prompts": ids, "responses": responses, "input_ids": torch.cat([ids, responses], 1),
            "attention_mask": torch.cat([prompts.batch["attention_mask"], mask], 1),
            "position_ids": torch.arange(ids.size(1) + 2).repeat(len(ids), 1)}))


def test_a_single_generation_puts_its_version_on_every_response_token(paths):
    config = load_config(compose_config(paths + ["actor_rollout_ref.rollout.n=2", "data.max_response_length=2",
                                                 "actor_rollout_ref.rollout.response_length=2"]))
    loop = SingleTurnRollout(tokenizer=None, engine=VersionedEngine(), config={}, is_validation=False)
    rollouts = StepRollouts(config, loop, loop, lambda batch: (torch.zeros(len(batch), 2), {}), DataProto)
    prompts = DataProto.from_dict(tensors={"input_ids": torch.ones(1, 3, dtype=torch.long),
                                           "attention_mask": torch.ones(1, 3, dtype=torch.long),
                                           "position_ids": torch.arange(3).unsqueeze(0)})
    batch, _ = rollouts.train_batch(prompts, 1, {})
    assert batch.batch[ROLLOUT_POLICY_VERSIONS].tolist() == [[7, 7], [7, -1]]


class Replicated(RolloutEngine):
    """Two replicas of the VersionedEngine kind."""

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        raise AssertionError("generation goes to the replicas")

    def replicas(self) -> list[RolloutEngine]:
        return [VersionedEngine(), VersionedEngine()]


def test_turn_signal_reports_each_returned_generation_of_the_engine_and_its_replicas():
    prompts = DataProto.from_dict(tensors={"input_ids": torch.ones(2, 3, dtype=torch.long),
                                           "attention_mask": torch.ones(2, 3, dtype=torch.long)})
    signal = TurnSignal(VersionedEngine())
    assert not signal.generated.is_set()
    out = signal.generate_sequences(prompts)
    assert signal.generated.is_set() and out.meta_info["policy_version"] == 7
    replicated = TurnSignal(Replicated())
    replicas = replicated.replicas()
    assert len(replicas) == 2 and all(r.generated is replicated.generated for r in replicas)
    replicas[1].generate_sequences(prompts)
    assert replicated.generated.is_set()


def test_rollout_ahead_reraises_the_rollouts_error_and_refuses_a_second_in_flight():
    def failing(prompts, step, timing):
        raise ValueError(f"step {step} failed")

    ahead = RolloutAhead(failing)
    try:
        ahead.start(DataProto(), 1)
        with pytest.raises(RuntimeError, match="step 1's rollout is still in flight"):
            ahead.start(DataProto(), 2)
        with pytest.raises(RuntimeError, match="no rollout of step 2 is in flight"):
            ahead.take(2)
        with pytest.raises(ValueError, match="step 1 failed"):
            ahead.take(1)
        assert not ahead.in_flight
    finally:
        ahead.close()


class FakeActor:
    """The actor worker as a Ray actor runs it: one call at a time; ``version`` counts the updates."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.lock, self.version = rng, threading.Lock(), 0

    def generate(self) -> int:
        """One generation call: the version of the weights it ran on (they cannot change during the call)."""
        with self.lock:
            version = self.version
            time.sleep(0.002)
            assert self.version == version
            return version

    def update(self) -> None:
        with self.lock:
            time.sleep(self.rng.uniform(0.005, 0.03))
            self.version += 1


def _dialogue_rollout(actor: FakeActor, rng: random.Random, rows: int, turns: int, tokens: int,
                      generated: threading.Event):
    """A turn-synchronous rollout: per turn one generation for every row (``generated`` set when it returns, as
    TurnSignal does), then a simulator answer whose latency is heavy-tailed (Pareto, alpha 1.5; the slowest user of
    the turn holds it); each token keeps its turn's version."""
    def rollout(prompts: DataProto, step: int, timing: dict[str, float]):
        versions = torch.full((rows, turns * tokens), -1, dtype=torch.long)
        for turn in range(turns):
            versions[:, turn * tokens:(turn + 1) * tokens] = actor.generate()
            generated.set()
            time.sleep(min(0.2, max(0.001 * rng.paretovariate(1.5) for _ in range(rows))))
        batch = DataProto.from_dict(tensors={"response_mask": torch.ones(rows, turns * tokens, dtype=torch.long),
                                             ROLLOUT_POLICY_VERSIONS: versions})
        return batch, {}
    return rollout


@pytest.mark.parametrize("seed", range(6))
def test_no_trained_token_is_more_than_one_version_behind_under_heavy_tailed_latency(seed):
    rng = random.Random(seed)
    actor = FakeActor(rng)
    steps, lags, generated = 6, [], threading.Event()
    ahead = RolloutAhead(_dialogue_rollout(actor, rng, rows=4, turns=rng.randint(2, 5), tokens=3, generated=generated),
                         generated)
    try:
        for step in range(1, steps + 1):
            taken, _ = take_and_refill(ahead, step, DataProto, lambda batch: {}, overlap_next=step < steps)
            assert actor.version == trainer_policy_version(step, 0)  # the proximal policy is the actor's now
            versions = taken.batch.batch[ROLLOUT_POLICY_VERSIONS]
            lags.append(int(actor.version - versions.min()))  # independent of staleness_metrics
            staleness_metrics(taken.batch, actor.version, threshold=1)
            actor.update()
    finally:
        ahead.close()
    # step 1 has nothing to overlap; every later rollout's first turn is generated before the previous update (the
    # trainer waits for it), so its oldest tokens are exactly one version behind, and none is further
    assert lags == [0] + [1] * (steps - 1)
