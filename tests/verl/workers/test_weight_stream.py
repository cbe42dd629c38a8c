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


class _Uneven(torch.nn.Module):
    """Parameters whose first dim does not divide by 2 ranks (rank 1 holds no row of ``tiny``)."""

    def __init__(self):
        super().__init__()
        self.rows7 = torch.nn.Parameter(torch.randn(7, 5))
        self.tiny = torch.nn.Parameter(torch.randn(1, 3))
        self.vector = torch.nn.Parameter(torch.randn(11))
        self.block = torch.nn.Parameter(torch.randn(9, 4, 2))


BUCKETS = {2**20: 1, 60: 3, 1: 4}  # bucket bytes -> collectives: 60 B holds 7x5 bf16 = 70 alone, 1x3 + 11 = 28,
#                                   then 9x4x2 = 144 alone; 1 B one parameter per bucket


def _bucketed_rank(rank: int, port: int, out_dir: str) -> None:
    import gc
    import os

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)  # the same full weights on every rank
    module = _Uneven()
    expected = {name: p.detach().to(torch.bfloat16).clone() for name, p in module.named_parameters()}
    fully_shard(module, mesh=init_device_mesh("cpu", (2,)))
    results = {}
    for bucket_bytes in BUCKETS:
        stats = WeightSyncStats()
        streamed = dict(fsdp_weight_stream(module, torch.bfloat16, stats, bucket_bytes=bucket_bytes))
        results[bucket_bytes] = {"streamed": streamed, "gathers": stats.gathers}
    torch.save({"expected": expected, "results": results}, os.path.join(out_dir, f"rank{rank}.pt"))
    del module  # its device mesh holds the group: release it first, so no gloo thread outlives the interpreter
    gc.collect()
    dist.destroy_process_group()


@pytest.mark.slow
def test_bucketed_gather_of_uneven_shards_equals_the_full_weights(tmp_path):
    """2 gloo ranks, FSDP2 shards of 7, 1, 11 and 9 rows (rank 1 holds no row of the 1-row parameter): every rank
    gets every full tensor, cast to bf16, with one collective per bucket."""
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(_bucketed_rank, args=(port, str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        for bucket_bytes, gathers in BUCKETS.items():
            result = saved["results"][bucket_bytes]
            assert sorted(result["streamed"]) == sorted(saved["expected"])
            for name, tensor in result["streamed"].items():
                assert tensor.dtype == torch.bfloat16, (rank, bucket_bytes, name)
                assert torch.equal(tensor, saved["expected"][name]), (rank, bucket_bytes, name)
            assert result["gathers"] == gathers, (rank, bucket_bytes)


def test_bucket_size_must_be_positive(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with pytest.raises(ValueError, match="update_weights_bucket_megabytes"):
        next(fsdp_weight_stream(model, torch.float32, bucket_bytes=0))
