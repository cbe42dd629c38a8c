"""Atomic checkpoint directories: partial dirs ignored, commit/rename, tracker file, retention, RNG state."""
import random

import numpy as np
import pytest
import torch

from verl.utils.checkpoint import (
    DIGESTS_FILE,
    STATE_FILE,
    TRACKER_FILE,
    apply_retention,
    atomic_write_text,
    begin_checkpoint,
    commit_checkpoint,
    find_latest_checkpoint,
    get_rng_state,
    list_checkpoints,
    load_trainer_state,
    remove_partial_checkpoints,
    save_trainer_state,
    set_rng_state,
    step_dir,
    step_of,
)


def _save(root, step, keep=None, payload="w"):
    partial = begin_checkpoint(root, step)
    (partial / "actor").mkdir()
    (partial / "actor" / "weights.bin").write_text(payload)
    save_trainer_state(partial, {"global_step": step, "dataloader": {"epoch": 0, "batch_index": step}})
    return commit_checkpoint(root, step, max_ckpt_to_keep=keep)


def test_commit_renames_and_updates_tracker(tmp_path):
    final = _save(tmp_path, 3)
    assert final == step_dir(tmp_path, 3) and final.is_dir()
    assert not (tmp_path / "global_step_3.partial").exists()
    assert (tmp_path / TRACKER_FILE).read_text().strip() == "3"
    assert load_trainer_state(final)["dataloader"]["batch_index"] == 3
    assert step_of(final) == 3
    assert find_latest_checkpoint(tmp_path) == final


def test_partial_directory_is_ignored(tmp_path):
    _save(tmp_path, 2)
    partial = begin_checkpoint(tmp_path, 4)
    save_trainer_state(partial, {"global_step": 4})  # fully written but never renamed: the run was killed
    assert find_latest_checkpoint(tmp_path) == step_dir(tmp_path, 2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2]
    assert remove_partial_checkpoints(tmp_path) == [partial]
    assert not partial.exists()


def test_directory_without_state_file_is_ignored(tmp_path):
    _save(tmp_path, 1)
    step_dir(tmp_path, 5).mkdir()
    assert find_latest_checkpoint(tmp_path) == step_dir(tmp_path, 1)


def test_commit_refuses_incomplete_checkpoint(tmp_path):
    begin_checkpoint(tmp_path, 7)
    with pytest.raises(FileNotFoundError, match=STATE_FILE):
        commit_checkpoint(tmp_path, 7)
    assert find_latest_checkpoint(tmp_path) is None


def test_empty_or_missing_root_has_no_checkpoint(tmp_path):
    assert find_latest_checkpoint(tmp_path / "nope") is None
    assert find_latest_checkpoint(tmp_path) is None


def test_retention_keeps_newest(tmp_path):
    for step in (1, 2, 3, 4, 5):
        _save(tmp_path, step, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5]
    assert (tmp_path / TRACKER_FILE).read_text().strip() == "5"
    assert apply_retention(tmp_path, None) == []
    assert len(list_checkpoints(tmp_path)) == 2


def test_resaving_a_step_replaces_it(tmp_path):
    _save(tmp_path, 2, payload="old")
    final = _save(tmp_path, 2, payload="new")
    assert (final / "actor" / "weights.bin").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_2", TRACKER_FILE, DIGESTS_FILE]


def test_atomic_write_leaves_no_temp_files(tmp_path):
    target = tmp_path / "f.txt"
    atomic_write_text(target, "a")
    atomic_write_text(target, "b")
    assert target.read_text() == "b"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_trainer_state_converts_numpy_and_rejects_objects(tmp_path):
    save_trainer_state(tmp_path, {"w": np.array([0.5, 1.5]), "n": np.int64(3), "t": torch.tensor([1, 2])})
    assert load_trainer_state(tmp_path) == {"w": [0.5, 1.5], "n": 3, "t": [1, 2]}
    with pytest.raises(TypeError, match="not JSON-serialisable"):
        save_trainer_state(tmp_path, {"bad": object()})


def test_rng_state_round_trips_through_json(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    save_trainer_state(tmp_path, {"rng": get_rng_state()})
    expected = (random.random(), np.random.rand(), torch.rand(3))
    set_rng_state(load_trainer_state(tmp_path)["rng"])
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert expected[0] == got[0] and expected[1] == got[1] and torch.equal(expected[2], got[2])


def test_retention_never_deletes_the_checkpoint_just_written(tmp_path):
    for step in (8, 9, 10):  # an earlier run (e.g. resume_mode=disable reusing the directory) left higher steps
        _save(tmp_path, step)
    final = _save(tmp_path, 1, keep=2, payload="new run")
    assert final.is_dir() and (final / "actor" / "weights.bin").read_text() == "new run"
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1, 10]
    assert (tmp_path / TRACKER_FILE).read_text().strip() == "1"
    assert find_latest_checkpoint(tmp_path) == final, "resume must continue the run that wrote last"


def test_tracker_naming_a_missing_step_falls_back_to_newest_complete(tmp_path):
    _save(tmp_path, 2)
    _save(tmp_path, 3)
    atomic_write_text(tmp_path / TRACKER_FILE, "7\n")  # e.g. killed between the rename of 7 and its contents
    assert find_latest_checkpoint(tmp_path) == step_dir(tmp_path, 3)
    atomic_write_text(tmp_path / TRACKER_FILE, "2\n")  # killed after committing 3 but before the tracker update
    assert find_latest_checkpoint(tmp_path) == step_dir(tmp_path, 2)


def test_kill_between_the_renames_of_a_resave_restores_the_old_copy(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 2, payload="old")
    partial = begin_checkpoint(tmp_path, 2)  # the re-save of step 2 is complete but not yet renamed ...
    (partial / "actor").mkdir()
    save_trainer_state(partial, {"global_step": 2})
    step_dir(tmp_path, 2).rename(tmp_path / "global_step_2.replaced")  # ... and the old copy was moved aside
    assert find_latest_checkpoint(tmp_path) == step_dir(tmp_path, 1)
    assert remove_partial_checkpoints(tmp_path) == [partial]
    assert (step_dir(tmp_path, 2) / "actor" / "weights.bin").read_text() == "old"
    assert find_latest_checkpoint(tmp_path) == step_dir(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1", "global_step_2", TRACKER_FILE,
                                                          DIGESTS_FILE]


def test_garbage_partial_of_a_killed_save_is_ignored_then_removed(tmp_path):
    _save(tmp_path, 3)
    partial = tmp_path / "global_step_4.partial"  # killed mid-save: torn files, even a torn state file
    (partial / "actor").mkdir(parents=True)
    (partial / "actor" / "model.safetensors").write_bytes(b"\x00garbage")
    (partial / STATE_FILE).write_text('{"global_step": 4, "dataloa')
    step_dir(tmp_path, 5).mkdir()  # a step directory without a state file is not a checkpoint either
    assert find_latest_checkpoint(tmp_path) == step_dir(tmp_path, 3)
    assert remove_partial_checkpoints(tmp_path) == [partial]
    assert load_trainer_state(find_latest_checkpoint(tmp_path))["global_step"] == 3
