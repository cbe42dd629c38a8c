"""Bad checkpoint state never blocks or misleads a resume (issue 12, item 12): a torn trainer_state.json falls
back to the newest valid checkpoint, bad keys and RNG states name the file, data is fsynced before the commit
rename, and retention prefers the run's own checkpoints over stale ones."""
from __future__ import annotations

import json
import logging
import os

import pytest

import verl.utils.checkpoint as ckpt
from verl.trainer.ppo.trainer_checkpoint import check_trainer_state
from verl.utils.checkpoint import (STATE_FILE, TRACKER_FILE, begin_checkpoint, commit_checkpoint,
                                   find_latest_checkpoint, get_rng_state, list_checkpoints, save_trainer_state,
                                   step_dir)


def _state(step: int) -> dict:
    return {"global_step": step, "dataloader": {"epoch": 0, "batch_index": step}, "kl_ctrl_value": 0.001,
            "rng": get_rng_state(), "total_training_steps": 10}


def _save(root, step, keep=None):
    partial = begin_checkpoint(root, step)
    (partial / "actor").mkdir()
    (partial / "actor" / "model.safetensors").write_bytes(os.urandom(4096))
    save_trainer_state(partial, _state(step))
    return commit_checkpoint(root, step, max_ckpt_to_keep=keep)


def test_a_truncated_trainer_state_falls_back_to_the_newest_valid_checkpoint(tmp_path, caplog):
    for step in (1, 2, 3):
        _save(tmp_path, step)
    state_file = step_dir(tmp_path, 3) / STATE_FILE
    state_file.write_text(state_file.read_text()[:100])  # torn by a crash of the disk, not by us
    with caplog.at_level(logging.WARNING, logger="verl.utils.checkpoint"):
        chosen = find_latest_checkpoint(tmp_path, check=check_trainer_state)
    assert chosen == step_dir(tmp_path, 2)
    text = caplog.text
    assert str(state_file) in text and "resuming from" in text and str(step_dir(tmp_path, 2)) in text


@pytest.mark.parametrize("damage, needle", [
    (lambda s: s.pop("kl_ctrl_value"), "has no 'kl_ctrl_value'"),
    (lambda s: s.pop("rng"), "has no 'rng'"),
    (lambda s: s["rng"].update(torch="not base64 !!"), "'rng.torch' is not a torch RNG state"),
    (lambda s: s["rng"].update(python=[3, [1, 2], None]), "'rng.python' is not a Python RNG state"),
    (lambda s: s["rng"]["numpy"].__setitem__(1, [1, 2, 3]), "'rng.numpy' is not a numpy RNG state"),
    (lambda s: s.update(global_step="3"), "'global_step' has the wrong type"),
    (lambda s: s.update(global_step=-5), "'global_step' is -5, but the checkpoint directory is global_step_1"),
    (lambda s: s.update(global_step=10**30), "but the checkpoint directory is global_step_1"),
    (lambda s: s.update(kl_ctrl_value=-1e9), "'kl_ctrl_value' must be a finite number >= 0"),
    (lambda s: s.update(dataloader={}), "'dataloader.epoch' must be an integer >= 0, got None"),
    (lambda s: s["dataloader"].update(epoch=-1), "'dataloader.epoch' must be an integer >= 0, got -1"),
    (lambda s: s["dataloader"].update(batch_index=True), "'dataloader.batch_index' must be an integer"),
])
def test_missing_keys_and_corrupt_rng_state_name_the_file(tmp_path, damage, needle):
    _save(tmp_path, 1)
    path = step_dir(tmp_path, 1)
    state = json.loads((path / STATE_FILE).read_text())
    damage(state)
    (path / STATE_FILE).write_text(json.dumps(state))
    with pytest.raises(ValueError) as err:
        check_trainer_state(path, state)
    assert str(path / STATE_FILE) in str(err.value) and needle in str(err.value)
    with pytest.raises(ValueError, match="no valid checkpoint under"):
        find_latest_checkpoint(tmp_path, check=check_trainer_state)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_kl_coefficient_falls_back_to_the_previous_checkpoint(tmp_path, literal):
    for step in (1, 2):
        _save(tmp_path, step)
    state_file = step_dir(tmp_path, 2) / STATE_FILE
    state_file.write_text(state_file.read_text().replace('"kl_ctrl_value": 0.001', f'"kl_ctrl_value": {literal}'))
    assert literal in state_file.read_text()
    assert find_latest_checkpoint(tmp_path, check=check_trainer_state) == step_dir(tmp_path, 1)


def test_a_deeply_nested_trainer_state_is_skipped_with_its_name(tmp_path, caplog):
    for step in (1, 2):
        _save(tmp_path, step)
    state_file = step_dir(tmp_path, 2) / STATE_FILE
    state_file.write_text('{"global_step": 2, "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with caplog.at_level(logging.WARNING, logger="verl.utils.checkpoint"):
        assert find_latest_checkpoint(tmp_path, check=check_trainer_state) == step_dir(tmp_path, 1)
    assert str(state_file) in caplog.text and "nested" in caplog.text


def test_a_non_finite_state_value_is_refused_at_save_time(tmp_path):
    partial = begin_checkpoint(tmp_path, 1)
    with pytest.raises(ValueError, match="non-finite"):
        save_trainer_state(partial, {**_state(1), "kl_ctrl_value": float("nan")})


def test_every_file_and_directory_is_fsynced_before_the_commit_rename(tmp_path, monkeypatch):
    synced: set[str] = set()
    real_fsync, real_replace, real_open = os.fsync, os.replace, os.open
    fds: dict[int, str] = {}

    def tracking_open(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        fds[fd] = os.path.realpath(path)
        return fd

    def tracking_fsync(fd):
        synced.add(fds.get(fd) or os.path.realpath(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    renamed_with_unsynced: list[str] = []

    def checking_replace(src, dst):
        src = os.fspath(src)
        if src.endswith(".partial"):
            for directory, dirs, files in os.walk(src):
                for name in [*files, *dirs]:
                    if os.path.realpath(os.path.join(directory, name)) not in synced:
                        renamed_with_unsynced.append(os.path.join(directory, name))
        return real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "open", tracking_open)
    monkeypatch.setattr(ckpt.os, "fsync", tracking_fsync)
    monkeypatch.setattr(ckpt.os, "replace", checking_replace)
    _save(tmp_path, 1)
    assert not renamed_with_unsynced, renamed_with_unsynced


def test_retention_after_a_resume_keeps_the_runs_own_checkpoints_over_stale_ones(tmp_path):
    """Resumed from 3 with stale 5 and 6 of an older run present: saving 4 used to keep {4, 6} and delete 3."""
    for step in (1, 2, 3, 5, 6):
        _save(tmp_path, step)
    (tmp_path / TRACKER_FILE).write_text("3\n")
    assert find_latest_checkpoint(tmp_path, check=check_trainer_state) == step_dir(tmp_path, 3)
    _save(tmp_path, 4, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 4]
    assert find_latest_checkpoint(tmp_path, check=check_trainer_state) == step_dir(tmp_path, 4)
