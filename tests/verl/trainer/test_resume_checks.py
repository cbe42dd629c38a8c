"""Which checkpoint a run resumes, decided before any worker starts: a checkpoint whose prompt-loader settings are not
this run's, whose files differ from its manifest or that has no manifest (without trainer.trust_checkpoint) is
skipped for an older valid one (resume_mode=auto) or refused in one line (resume_path); the choice is made and its
files hashed once."""
from __future__ import annotations

import json

import pytest

import verl.trainer.ppo.trainer_checkpoint as trainer_checkpoint
from verl.trainer.config_schema import ConfigError, TrainerConfig
from verl.trainer.ppo.trainer_checkpoint import TrainerCheckpoints
from verl.utils.checkpoint import (STATE_FILE, begin_checkpoint, commit_checkpoint, get_rng_state, save_trainer_state,
                                   step_dir)
from verl.utils.checkpoint_manifest import MANIFEST_FILE, write_manifest

LOADER = {"seed": 0, "batch_size": 4, "num_samples": 64, "shuffle": 1}


def _save(root, step, **dataloader):
    partial = begin_checkpoint(root, step)
    (partial / "actor" / "sharded_state").mkdir(parents=True)
    (partial / "actor" / "sharded_state" / ".metadata").write_bytes(b"weights")
    write_manifest(partial / "actor")
    save_trainer_state(partial, {"global_step": step, "kl_ctrl_value": 0.0, "rng": get_rng_state(),
                                 "dataloader": {"epoch": 0, "batch_index": step, **LOADER, **dataloader}})
    return commit_checkpoint(root, step)


def _checkpoints(root, **trainer) -> TrainerCheckpoints:
    return TrainerCheckpoints(TrainerConfig(default_local_dir=str(root), **trainer), "model", loader=LOADER)


def test_a_newer_checkpoint_of_other_loader_settings_is_skipped_before_the_workers_load(tmp_path, caplog):
    _save(tmp_path, 1)
    _save(tmp_path, 2, seed=7)  # saved by a run whose data.seed differed: its position means other prompts
    assert _checkpoints(tmp_path).to_resume() == step_dir(tmp_path, 2).parent / "global_step_1"
    assert "'dataloader.seed' is 7, this run's prompt loader has 0" in caplog.text


@pytest.mark.parametrize("seed", ["7", 1e30, True, None, -1])
def test_a_tampered_loader_setting_given_as_resume_path_is_one_line_error(tmp_path, seed):
    step = _save(tmp_path, 1, seed=seed)
    with pytest.raises(ConfigError, match=r"trainer.resume_from_path: .*'dataloader.seed' is") as err:
        _checkpoints(tmp_path, resume_mode="resume_path", resume_from_path=str(step)).to_resume()
    assert "\n" not in str(err.value)


def test_a_checkpoint_changed_after_its_save_is_skipped(tmp_path, caplog):
    _save(tmp_path, 1)
    newer = _save(tmp_path, 2)
    (newer / "actor" / "sharded_state" / ".metadata").write_bytes(b"crafted")
    assert _checkpoints(tmp_path).to_resume() == step_dir(tmp_path, 1)
    assert "sharded_state/.metadata does not match its manifest" in caplog.text


def test_a_replaced_step_directory_is_caught_by_the_runs_record(tmp_path, caplog):
    _save(tmp_path, 1)
    newer = _save(tmp_path, 2)
    (newer / "actor" / "sharded_state" / ".metadata").write_bytes(b"crafted")
    write_manifest(newer / "actor")
    write_manifest(newer)  # a consistent, but foreign, global_step_2
    assert _checkpoints(tmp_path).to_resume() == step_dir(tmp_path, 1)
    assert "not the manifest this checkpoint was saved with" in caplog.text


def test_a_checkpoint_without_a_manifest_needs_trust_checkpoint(tmp_path):
    step = _save(tmp_path, 1)
    for manifest in (step / MANIFEST_FILE, step / "actor" / MANIFEST_FILE):
        manifest.unlink()
    (tmp_path / "manifest_digests.json").unlink()
    with pytest.raises(ConfigError, match="no checkpoint_manifest.json .*trainer.trust_checkpoint=true") as err:
        _checkpoints(tmp_path).to_resume()
    assert "\n" not in str(err.value)
    assert _checkpoints(tmp_path, trust_checkpoint=True).to_resume() == step


def test_the_checkpoint_is_chosen_and_hashed_once(tmp_path, monkeypatch):
    _save(tmp_path, 1)
    calls = []
    real = trainer_checkpoint.verify_checkpoint
    monkeypatch.setattr(trainer_checkpoint, "verify_checkpoint", lambda *a, **k: calls.append(a) or real(*a, **k))
    checkpoints = _checkpoints(tmp_path)
    checkpoints.check_resume_model()
    assert checkpoints.to_resume() == step_dir(tmp_path, 1) and len(calls) == 1
    assert json.loads((step_dir(tmp_path, 1) / STATE_FILE).read_text())["global_step"] == 1
