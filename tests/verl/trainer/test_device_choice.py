"""trainer.device: the GPU preset's ``cuda`` fails loudly on a CPU-only torch; ``auto`` falls back to the CPU."""

from __future__ import annotations

import pytest
import torch

from verl.trainer.config_schema import ConfigError, compose_config
from verl.trainer.config_validation import build_config
from verl.trainer.main_ppo import resolve_device

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")


def test_cuda_without_a_gpu_is_a_config_error():
    typed = build_config(compose_config(["trainer.device=cuda"]))
    with pytest.raises(ConfigError, match="trainer.device=cuda but no CUDA device"):
        resolve_device(typed)


@pytest.mark.parametrize("device", ["auto", "cpu"])
def test_auto_and_cpu_run_on_the_cpu(device):
    assert resolve_device(build_config(compose_config([f"trainer.device={device}"]))) == "cpu"
