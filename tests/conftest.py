"""Shared pytest fixtures: the tiny local model and a quiet, CPU-only environment."""
from __future__ import annotations

import os

import pytest

for _key, _value in {
    "OMP_NUM_THREADS": "1",
    "TORCHDYNAMO_DISABLE": "1",
    "WANDB_MODE": "offline",
    "RAY_AUTH_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
}.items():
    os.environ.setdefault(_key, _value)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    """Directory of the tiny Qwen2 model and tokenizer, built once per test session."""
    from utils.make_tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0))
