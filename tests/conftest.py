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


@pytest.fixture()
def ray_cluster():
    """A local Ray instance for one test (8 logical CPUs: placement needs slots, not cores)."""
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    """Directory of the tiny Qwen2 model and tokenizer, built once per test session."""
    from utils.make_tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0))




@pytest.fixture(scope="session")
def warm_model_path(tiny_model_path, tmp_path_factory) -> str:
    """The tiny model fine-tuned (160 SFT steps, ~40 s) on scripted SOP-following calls with the compact system
    prompt, so that about half of its sampled turns and most of its greedy ones carry the reply tag and reach the
    simulator. (At 80 steps the loss was still ~1.1, just before it falls: on 2026-11-25 that model's greedy turns
    were all format errors, while on the machine the tests were written on it had passed.)"""
    from llm_agent.scenario import DEFAULT_SCENARIO_PATH
    from tests.helpers.repo import COMPACT_SYSTEM_PROMPT
    from utils.sft_warm_start import scripted_dialogues, sft_on_dialogues

    dialogues = scripted_dialogues(str(DEFAULT_SCENARIO_PATH), 32, {"good": 1.0}, seed=0, max_turns=4,
                                   system_prompt=COMPACT_SYSTEM_PROMPT)
    out = sft_on_dialogues(tiny_model_path, tmp_path_factory.mktemp("warm_model"), dialogues, steps=160, lr=1e-2,
                           batch_size=8, seed=0)
    return str(out)
