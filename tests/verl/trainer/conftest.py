"""Fixtures shared by the trainer's config tests."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture()
def paths(tmp_path: Path) -> list[str]:
    """The overrides every valid config needs: a model directory and a train file that exist."""
    model = tmp_path / "model"
    model.mkdir()
    train = tmp_path / "train.parquet"
    train.write_bytes(b"x")
    return [f"actor_rollout_ref.model.path={model}", f"data.train_files={train}"]


@pytest.fixture()
def model_14b(tmp_path: Path) -> str:
    """A Qwen2.5-14B model directory (its config.json only) for the planner's tests."""
    from tests.helpers.plan_presets import write_model_14b

    return write_model_14b(tmp_path)
