"""Tests of verl.utils.tracking: each backend really writes what was logged."""

import json
import logging

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl.utils.tracking import Tracking


def test_jsonl_one_object_per_step_flushed_immediately(tmp_path):
    tracker = Tracking("proj", "exp", default_backend=["jsonl"], config={"lr": 0.1}, log_dir=tmp_path)
    tracker.log({"actor/loss": torch.tensor(0.25), "n": 3, "r": np.float32(1.5)}, step=1)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"step": 1, "actor/loss": 0.25, "n": 3, "r": 1.5}]
    tracker.log({"actor/loss": 0.125}, step=2)
    tracker.finish()
    tracker.finish()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[1]) == {"step": 2, "actor/loss": 0.125}
    with pytest.raises(RuntimeError, match="after finish"):
        tracker.log({"x": 1.0}, step=3)


def test_console_compact_line(caplog, tmp_path):
    caplog.set_level(logging.INFO, logger="verl.tracking")
    with Tracking("proj", "exp", default_backend="console", log_dir=tmp_path) as tracker:
        tracker.log({"a": 0.5, "b": 1 / 3, "n": 7}, step=4)
    lines = [r.getMessage() for r in caplog.records if r.name == "verl.tracking"]
    assert lines == ["step:4 - a:0.5 - b:0.333333 - n:7"]
    assert not (tmp_path / "metrics.jsonl").exists()


def test_tensorboard_event_file_holds_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = OmegaConf.create({"lr": 0.1, "twice": "${lr}"})
    with Tracking("proj", "exp", default_backend=["tensorboard"], config=config, log_dir=tmp_path) as tracker:
        assert tracker.config == {"lr": 0.1, "twice": 0.1}
        tracker.log({"critic/vf_loss": 2.0}, step=1)
        tracker.log({"critic/vf_loss": 1.0}, step=2)
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    scalars = accumulator.Scalars("critic/vf_loss")
    assert [(s.step, s.value) for s in scalars] == [(1, 2.0), (2, 1.0)]


def test_bad_backend_and_bad_metric(tmp_path):
    with pytest.raises(ValueError, match=r"'neptune'.*console.*jsonl.*wandb.*tensorboard.*mlflow"):
        Tracking("p", "e", default_backend=["console", "neptune"], log_dir=tmp_path)
    with Tracking("p", "e", default_backend=["jsonl"], log_dir=tmp_path) as tracker:
        with pytest.raises(ValueError, match="'vec'.*shape"):
            tracker.log({"vec": torch.ones(3)}, step=0)
        with pytest.raises(ValueError, match="'name'.*number"):
            tracker.log({"name": "abc"}, step=0)


@pytest.mark.processes
@pytest.mark.parametrize("wandb_mode", ["offline", None])
def test_wandb_runs_offline_without_api_key(tmp_path, monkeypatch, wandb_mode):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    (tmp_path / "netrc").write_text("")  # no `wandb login` either, whatever the machine has
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    if wandb_mode is None:
        monkeypatch.delenv("WANDB_MODE", raising=False)
    else:
        monkeypatch.setenv("WANDB_MODE", wandb_mode)
    with Tracking("proj", "exp", default_backend=["wandb", "jsonl"], config={"lr": 0.1}, log_dir=tmp_path) as tracker:
        tracker.log({"reward": 1.0}, step=1)
        tracker.log({"reward": 2.0}, step=2)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("run-*.wandb")), f"no .wandb data file in {runs[0]}"
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("env, netrc_host, expected", [
    ({}, None, "offline"),                                      # nothing configured
    ({"WANDB_API_KEY": "k" * 40}, None, "online"),
    ({}, "api.wandb.ai", "online"),                             # what `wandb login` writes
    ({"WANDB_BASE_URL": "https://wandb.example.org"}, "api.wandb.ai", "offline"),  # a login for another host
    ({"WANDB_MODE": "offline", "WANDB_API_KEY": "k" * 40}, None, "offline"),  # the user's own mode wins
    ({"WANDB_MODE": "disabled"}, "api.wandb.ai", "disabled"),
])
def test_wandb_mode_honours_the_users_settings(tmp_path, monkeypatch, env, netrc_host, expected):
    from verl.utils.tracking_backends import wandb_mode

    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text(f"machine {netrc_host} login user password {'p' * 40}\n" if netrc_host else "")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert wandb_mode() == expected


@pytest.mark.processes
def test_mlflow_local_store_holds_metrics_params_and_tables(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with Tracking("proj", "exp", default_backend=["mlflow"], config={"actor": {"lr": 0.1}}, log_dir=tmp_path) as t:
        t.log({"reward/mean": 1.0}, step=1)
        t.log({"reward/mean": 2.5}, step=2)
        t.log_table("val/generations", ["input", "output"], [["hi", "hello | there"]], step=2)
        run_id = t._mlflow.run_id
    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    history = client.get_metric_history(run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(1, 1.0), (2, 2.5)]
    run = client.get_run(run_id)
    assert run.data.params == {"actor.lr": "0.1"} and run.info.status == "FINISHED"
    assert "hello \\| there" in (tmp_path / "mlruns").joinpath(*_artifact(tmp_path, run_id)).read_text()


def _artifact(tmp_path, run_id):
    """The path parts of the table's artifact file under mlruns/."""
    found = next((tmp_path / "mlruns").rglob("step_2.md"))
    return found.relative_to(tmp_path / "mlruns").parts


def test_tables_go_to_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Tracking("p", "e", default_backend=["jsonl", "tensorboard"], log_dir=tmp_path) as tracker:
        tracker.log_table("val/generations", ["input", "output", "score"], [["a|b", "line1\nline2", 1.0]], step=3)
        with pytest.raises(ValueError, match="3 cells"):
            tracker.log_table("t", ["a", "b", "c"], [["only one"]], step=3)
    line = json.loads((tmp_path / "val_generations.jsonl").read_text())
    assert line == {"step": 3, "columns": ["input", "output", "score"], "rows": [["a|b", "line1\nline2", "1.0"]]}
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    assert "val/generations/text_summary" in accumulator.Tags()["tensors"]
