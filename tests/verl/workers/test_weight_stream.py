"""fsdp_weight_stream: the full weights of an FSDP2 / FSDP1 model under their HF names, in the rollout dtype."""
from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from verl.utils.fsdp_utils import build_fsdp_model, create_device_mesh
from verl.workers.rollout.vllm_rollout.weight_sync import WeightSyncStats, fsdp_weight_stream, hf_parameter_name


@pytest.fixture(scope="module")
def one_rank_group():
    """A 1-rank gloo group (what a worker has), destroyed afterwards."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_wrapper_name_parts_are_removed():
    assert hf_parameter_name("_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module."
                             "mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp"])
def test_stream_equals_the_plain_model(one_rank_group, tiny_model_path, strategy):
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    module = build_fsdp_model(AutoModelForCausalLM, tiny_model_path, create_device_mesh("cpu"),
                              {"param_dtype": "fp32"}, seed=0, strategy=strategy, gradient_checkpointing=True)
    with torch.no_grad():  # a change the stream must carry (not the checkpoint on disk)
        for name, param in module.named_parameters():
            if "embed_tokens" in name:
                param.mul_(2.0)
    expected = {name: p.detach() for name, p in plain.named_parameters()}
    expected["model.embed_tokens.weight"] = expected["model.embed_tokens.weight"] * 2
    stats = WeightSyncStats()
    streamed = dict(fsdp_weight_stream(module, torch.bfloat16, stats))
    assert sorted(streamed) == sorted(expected)
    for name, tensor in streamed.items():
        assert tensor.dtype == torch.bfloat16 and tensor.shape == expected[name].shape, name
        assert torch.equal(tensor, expected[name].to(torch.bfloat16)), name
    assert stats.tensors == len(expected)
    assert stats.bytes == sum(t.numel() * 2 for t in expected.values())
