"""Checkpoint manifests: written with every commit, verified before a checkpoint is opened, recorded outside the step
directory; what they catch (a changed, added, missing or linked file, a path out of the directory, a replaced
manifest when the run's record is consulted) and what they do not (a rewritten manifest alone: docs/checkpoints.md)."""
from __future__ import annotations

import json
import os

import pytest

import verl.utils.checkpoint as checkpoint
from verl.utils.checkpoint import (DIGESTS_FILE, begin_checkpoint, commit_checkpoint, recorded_digest,
                                   remove_partial_checkpoints, save_trainer_state, step_dir)
from verl.utils.checkpoint_manifest import (MANIFEST_FILE, CheckpointTrustError, manifest_digest, verify_checkpoint,
                                            write_manifest)


def _save(root, step, payload="weights", keep=None):
    partial = begin_checkpoint(root, step)
    (partial / "actor" / "sharded_state").mkdir(parents=True)
    (partial / "actor" / "sharded_state" / ".metadata").write_text(payload)
    (partial / "actor" / "config.json").write_text("{}")
    write_manifest(partial / "actor")  # as the workers' checkpoint manager does
    (partial / "rollout_loop").mkdir()
    (partial / "rollout_loop" / "cache.jsonl").write_text("{}\n")
    save_trainer_state(partial, {"global_step": step})
    return commit_checkpoint(root, step, max_ckpt_to_keep=keep)


def test_a_committed_checkpoint_lists_each_file_once_and_verifies(tmp_path):
    final = _save(tmp_path, 1)
    listed = json.loads((final / MANIFEST_FILE).read_text())["files"]
    assert sorted(listed) == ["actor/checkpoint_manifest.json", "rollout_loop/cache.jsonl", "trainer_state.json"]
    actor = json.loads((final / "actor" / MANIFEST_FILE).read_text())["files"]
    assert sorted(actor) == ["config.json", "sharded_state/.metadata"]
    assert verify_checkpoint(final, expected_digest=recorded_digest(final)) is True
    assert verify_checkpoint(final / "actor") is True
    assert recorded_digest(final) == manifest_digest(final)


@pytest.mark.parametrize("change, match", [
    (lambda d: (d / "actor" / "sharded_state" / ".metadata").write_text("weightz"), "does not match its manifest"),
    (lambda d: (d / "actor" / "sharded_state" / ".metadata").write_text("w"), "has 1 bytes, its manifest says 7"),
    (lambda d: (d / "actor" / "config.json").unlink(), "lacks config.json"),
    (lambda d: (d / "actor" / "extra.pt").write_text("x"), "holds extra.pt, which its manifest does not list"),
    (lambda d: (d / "trainer_state.json").write_text('{\n "global_step": 2\n}'), "trainer_state.json does not match"),
    (lambda d: os.symlink("/etc/hostname", d / "actor" / "link"), "is a symbolic link"),
])
def test_any_change_after_the_save_is_refused_naming_the_file(tmp_path, change, match):
    final = _save(tmp_path, 1)
    change(final)
    with pytest.raises(CheckpointTrustError, match=match) as err:
        verify_checkpoint(final)
    assert "\n" not in str(err.value)


def test_a_checkpoint_without_a_manifest_needs_the_trust_flag(tmp_path, caplog):
    (tmp_path / "actor").mkdir()
    (tmp_path / "actor" / "config.json").write_text("{}")
    with pytest.raises(CheckpointTrustError, match="has no checkpoint_manifest.json .* pass --trust_checkpoint"):
        verify_checkpoint(tmp_path / "actor", flag="--trust_checkpoint")
    assert verify_checkpoint(tmp_path / "actor", trust_unverified=True, flag="--trust_checkpoint") is False
    assert "without a manifest (--trust_checkpoint given)" in caplog.text


@pytest.mark.parametrize("name", ["../outside", "/etc/hostname", "a/../../b", "./x", "a//b"])
def test_a_manifest_naming_a_path_outside_the_checkpoint_is_refused(tmp_path, name):
    (tmp_path / "outside").write_text("x")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    body = {"format": "sead-checkpoint-manifest/1", "algorithm": "sha256",
            "files": {name: {"sha256": "0" * 64, "bytes": 1}}}
    (ckpt / MANIFEST_FILE).write_text(json.dumps(body))
    with pytest.raises(CheckpointTrustError, match="a path outside the checkpoint"):
        verify_checkpoint(ckpt)


@pytest.mark.parametrize("text", ["", "[]", '{"format": "other"}', "{" * 10000, '{"format": "sead-checkpoint-'
                                  'manifest/1", "files": {"a": {"sha256": 5, "bytes": -1}}}'])
def test_a_malformed_manifest_is_one_line_error(tmp_path, text):
    (tmp_path / MANIFEST_FILE).write_text(text)
    with pytest.raises(CheckpointTrustError) as err:
        verify_checkpoint(tmp_path)
    assert "\n" not in str(err.value)


def test_a_rewritten_manifest_passes_alone_but_not_against_the_runs_record(tmp_path):
    final = _save(tmp_path, 1)
    (final / "actor" / "sharded_state" / ".metadata").write_text("tampered")
    write_manifest(final / "actor")  # whoever can write the checkpoint can rewrite its manifests
    write_manifest(final)
    assert verify_checkpoint(final) is True, "a manifest alone proves integrity since the save, not origin"
    with pytest.raises(CheckpointTrustError, match="not the manifest this checkpoint was saved with"):
        verify_checkpoint(final, expected_digest=recorded_digest(final))


def test_retention_forgets_the_digests_of_removed_checkpoints(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step, keep=2)
    assert sorted(json.loads((tmp_path / DIGESTS_FILE).read_text())) == ["global_step_2", "global_step_3"]


def test_an_interrupted_resave_restores_the_old_copy_and_its_record(tmp_path, monkeypatch):
    _save(tmp_path, 1, payload="old")
    real_replace = os.replace

    def killed_before_the_second_rename(src, dst):
        if str(src).endswith(".partial"):
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", killed_before_the_second_rename)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 1, payload="new")
    monkeypatch.setattr(checkpoint.os, "replace", real_replace)
    aside = tmp_path / "global_step_1.replaced"  # the old copy moved aside; the record names the new one
    assert aside.is_dir() and recorded_digest(step_dir(tmp_path, 1)) != manifest_digest(aside)
    remove_partial_checkpoints(tmp_path)
    final = step_dir(tmp_path, 1)
    assert (final / "actor" / "sharded_state" / ".metadata").read_text() == "old"
    assert verify_checkpoint(final, expected_digest=recorded_digest(final)) is True


def test_a_removed_manifest_is_caught_by_the_runs_record_even_when_trusted(tmp_path):
    final = _save(tmp_path, 1)
    (final / MANIFEST_FILE).unlink()
    with pytest.raises(CheckpointTrustError, match="the run that wrote it recorded one: it was removed"):
        verify_checkpoint(final, trust_unverified=True, expected_digest=recorded_digest(final))
