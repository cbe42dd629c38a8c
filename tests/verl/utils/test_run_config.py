"""trainer_config.json: a checkpoint's recorded training config, secrets left out, read back with its paths."""
from __future__ import annotations

import json

import pytest

from verl.utils.run_config import CONFIG_FILE, load_run_config, redact_secrets, save_run_config


def test_round_trip_redacts_secrets_and_resolves_relative_paths(tmp_path):
    config = {"data": {"val_files": "outputs/prompt_data/x/test.parquet", "max_prompt_length": 96},
              "rollout_loop": {"config": {"max_turns": 10, "max_user_tokens": 48, "max_tokens_per_turn": 64,
                                          "user_sim": {"api_key": "sk-secret-1", "urls": ["http://127.0.0.1:1"]}}},
              "trainer": {"wandb_token": "tok-2", "hf_token": None, "db_password": "pw-3", "experiment_name": "x"},
              "list": [{"client_secret": "s-4"}]}
    path = save_run_config(tmp_path, config, cwd="/runs/here")
    text = path.read_text()
    assert path.name == CONFIG_FILE and not any(s in text for s in ("sk-secret-1", "tok-2", "pw-3", "s-4"))
    got = load_run_config(tmp_path)
    assert got.cwd == "/runs/here" and got.select("rollout_loop.config.max_turns") == 10
    assert got.select("rollout_loop.config.user_sim.api_key") is None and got.select("trainer.wandb_token") is None
    assert got.select("rollout_loop.config.max_user_tokens") == 48  # "tokens" keys are not secrets
    assert got.select("data.nothing.here") is None and got.select("data.max_prompt_length.deeper") is None
    assert got.resolve("outputs/a.parquet") == "/runs/here/outputs/a.parquet" and got.resolve("/abs/b") == "/abs/b"
    assert redact_secrets({"list": [{"client_secret": "s"}]}) == {"list": [{"client_secret": None}]}


def test_a_missing_file_is_none_and_a_broken_one_is_named(tmp_path):
    assert load_run_config(tmp_path) is None
    (tmp_path / CONFIG_FILE).write_text('{"cwd": "/x", "config": {"a": ')
    with pytest.raises(ValueError, match=CONFIG_FILE):
        load_run_config(tmp_path)
    (tmp_path / CONFIG_FILE).write_text(json.dumps({"config": []}))
    with pytest.raises(ValueError, match="expected"):
        load_run_config(tmp_path)
