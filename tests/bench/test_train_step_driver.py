"""bench/train_step.py end to end on CPU (the GPU preset's code path with the tiny model): the driver never calls
torch.cuda, the device facts come from the worker processes, and MFU / HFU follow from the reported times."""
from __future__ import annotations

import inspect
import json
import os
import statistics
from pathlib import Path

import pytest
import torch

from bench import train_step

REPO = Path(__file__).resolve().parents[2]
CUDA_CALLS = ("is_available", "device_count", "current_device", "get_device_name", "get_device_properties",
              "synchronize", "max_memory_allocated", "max_memory_reserved", "reset_peak_memory_stats",
              "set_device", "init", "_lazy_init")


@pytest.fixture()
def driver_cuda_calls(monkeypatch):
    """Record every torch.cuda call made in this (the driver's) process from the repository's own code;
    ``_lazy_init`` (what opens a CUDA context) is recorded from anywhere."""
    calls: list[str] = []

    def spy(name, original):
        def wrapper(*args, **kwargs):
            caller = Path(inspect.stack()[1].filename).resolve()
            if name == "_lazy_init" or REPO in caller.parents and ".venv" not in caller.parts:
                calls.append(f"torch.cuda.{name} from {caller}")
            return original(*args, **kwargs)
        return wrapper

    for name in CUDA_CALLS:
        monkeypatch.setattr(torch.cuda, name, spy(name, getattr(torch.cuda, name)))
    return calls


def _model_flops_by_hand(config: dict, rows: int, prompt: int, response: int) -> tuple[float, float]:
    """(model, hardware) FLOPs of one update of full-length rows, written out from the definitions."""
    h, inter, layers, vocab = (config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                   "vocab_size"))
    head_dim = h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    t = prompt + response
    per_token = 0
    for _ in range(layers):
        per_token += 2 * (h * q + h * kv + h * kv + q * h + h * inter + h * inter + inter * h)
    causal_pairs = sum(i + 1 for i in range(t))
    attention = rows * layers * config["num_attention_heads"] * causal_pairs * 2 * (2 * head_dim)
    forward = per_token * rows * t + 2 * h * vocab * rows * response + attention
    recompute = (per_token - layers * 2 * inter * h) * rows * t + attention
    return 3 * forward, 3 * forward + recompute


@pytest.mark.processes
def test_gpu_preset_path_on_cpu(tmp_path, driver_cuda_calls):
    out = tmp_path / "train_step_gpu.json"
    result = train_step.main(["--preset", "gpu", "--model", "tiny", "--device", "cpu", "--workers", "1",
                              "--prompt-length", "40", "--response-length", "24", "--iters", "2",
                              "--peak-tflops", "0.5", "--out", str(out)])
    assert driver_cuda_calls == []
    assert not torch.cuda.is_initialized()
    row = result["results"][0]
    info = row["device_info"][0]
    assert info["pid"] != os.getpid() and info["cuda"] is False  # read inside the worker process
    assert result["device"] == info["name"]
    # the preset: micro-batch 1, log-prob micro-batch 2, checkpointing, 4 rows per GPU
    assert (result["micro_batch"], result["log_prob_micro_batch"], result["batch"]) == (1, 2, 4)
    assert result["gradient_checkpointing"] is True and row["setup"] == "packed"
    # timings measured in the worker sit inside the driver's wall time of the same calls
    assert len(row["update_s_all"]) == 2
    assert all(0 < w <= d for w, d in zip(row["update_s_all"], row["update_wall_s_all"]))
    assert row["update_s"] == statistics.median(row["update_s_all"])
    model, hardware = _model_flops_by_hand(result["model_config"], rows=4, prompt=40, response=24)
    assert row["flops"]["model"] == model and row["flops"]["hardware"] == hardware
    assert row["mfu"] == pytest.approx(model / (row["update_s"] * 0.5e12))
    assert row["hfu"] == pytest.approx(hardware / (row["update_s"] * 0.5e12))
    assert row["log_prob_mfu"] == pytest.approx(model / 3 / (row["log_prob_s"] * 0.5e12))
    assert row["peak_allocated_mib"] is None and row["peak_rss_mib"] > 0  # CPU: resident set size only
    assert row["planned_update_mib"] > 0
    assert json.loads(out.read_text())["results"][0]["mfu"] == row["mfu"]
