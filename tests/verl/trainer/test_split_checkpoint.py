"""A rollout of its own in a checkpoint: each rank's RNG states (they draw its samples) saved and restored, a corrupt
file named, and a checkpoint without states for this rollout's ranks resumed with fresh streams and a warning. That
a resumed split run then trains the uninterrupted run's batches: tests/verl/trainer/test_off_policy_training.py."""
from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch

from tests.helpers.ppo_batch_helpers import actor_rollout_ref_config
from verl.trainer.ppo.trainer_checkpoint import ROLLOUT_DIR, restore_rollout_rng
from verl.workers.rollout_worker import StandaloneRolloutWorker, rng_file


def _draws() -> tuple:
    return torch.rand(4).tolist(), random.random(), float(np.random.rand())


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def test_a_rollout_ranks_rng_states_round_trip_and_a_corrupt_file_is_named(tmp_path):
    worker = StandaloneRolloutWorker(actor_rollout_ref_config("/nonexistent"))  # rank 0, nothing loaded
    _seed_everything(7)
    worker.save_rollout_state(str(tmp_path))
    expected = _draws()
    _seed_everything(0)
    assert _draws() != expected
    worker.load_rollout_state(str(tmp_path))
    assert _draws() == expected
    for text in ('{"python": 1}', '{"python"', "[]"):
        (tmp_path / rng_file(0)).write_text(text)
        with pytest.raises(ValueError, match=r"rng_rank_0.json: not the rollout rank's RNG states"):
            worker.load_rollout_state(str(tmp_path))


class RecordingGroup:
    """The two calls restore_rollout_rng makes on a rollout worker group of `world_size` ranks."""

    def __init__(self, world_size: int) -> None:
        self.world_size, self.loaded = world_size, []

    def load_rollout_state(self, path: str) -> None:
        self.loaded.append(path)


def test_without_states_for_every_rollout_rank_a_resume_keeps_fresh_streams_and_says_so(tmp_path, caplog):
    group = RecordingGroup(2)
    with caplog.at_level(logging.WARNING):
        restore_rollout_rng(tmp_path, group)  # a colocated run's checkpoint: no rollout/
    assert group.loaded == [] and "holds the RNG states of 0 rollout ranks, this run's rollout has 2" in caplog.text
    (tmp_path / ROLLOUT_DIR).mkdir()
    (tmp_path / ROLLOUT_DIR / rng_file(0)).write_text("{}")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        restore_rollout_rng(tmp_path, group)  # saved by a rollout of one rank
    assert group.loaded == [] and "holds the RNG states of 1 rollout ranks" in caplog.text
    (tmp_path / ROLLOUT_DIR / rng_file(1)).write_text("{}")
    restore_rollout_rng(tmp_path, group)
    assert group.loaded == [str(tmp_path / ROLLOUT_DIR)]
