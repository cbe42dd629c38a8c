"""FSDP2 model building on 2 gloo ranks: only rank 0 reads the checkpoint, the others get their shards by
broadcast; the result equals the checkpoint (and a single-process model's outputs) on every rank, and a frozen
model is kept in the compute dtype."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.processes


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, model_path: str, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from verl.utils.fsdp_utils import build_fsdp_model, create_device_mesh, full_state_dict

    if rank != 0:  # a rank > 0 that touched the checkpoint would fail here
        def refuse(*args, **kwargs):
            raise AssertionError("rank 1 read the checkpoint")

        AutoModelForCausalLM.from_pretrained = refuse
        AutoModelForTokenClassification.from_pretrained = refuse
    mesh = create_device_mesh("cpu")
    results = {}
    torch.manual_seed(123)
    input_ids = torch.randint(0, 1000, (2, 12))
    for name, cls, dtype, overrides in [
        ("policy", AutoModelForCausalLM, torch.float32, None),
        ("reference", AutoModelForCausalLM, torch.bfloat16, None),
        ("critic", AutoModelForTokenClassification, torch.float32, {"num_labels": 1, "classifier_dropout": 0.0}),
    ]:
        model = build_fsdp_model(cls, model_path, mesh, {"param_dtype": "fp32"}, seed=7, config_overrides=overrides,
                                 master_dtype=dtype)
        with torch.no_grad():
            logits = model(input_ids=input_ids).logits
        results[name] = {
            "state": {k: v.clone() for k, v in full_state_dict(model).items()},
            "logits": logits.clone(),
            "shard_dtypes": {p.to_local().dtype for p in model.parameters()},
            "buffers": {k: b.clone() for k, b in model.named_buffers()},
        }
    torch.save({"input_ids": input_ids, **results}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def test_rank0_loads_and_every_rank_gets_equal_weights(tiny_model_path, tmp_path):
    mp.start_processes(_rank_main, args=(tiny_model_path, _free_port(), str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    input_ids = ranks[0]["input_ids"]
    # today's path: the checkpoint loaded in one process (the value head initialised after the same seed)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    torch.manual_seed(7)
    config = AutoConfig.from_pretrained(tiny_model_path, num_labels=1, classifier_dropout=0.0)
    critic = AutoModelForTokenClassification.from_pretrained(tiny_model_path, config=config,
                                                             dtype=torch.float32).eval()
    expected = {"policy": policy, "critic": critic}
    for rank in ranks:
        for name in ("policy", "critic"):
            reference_state = expected[name].state_dict()
            assert rank[name]["state"].keys() == reference_state.keys()
            for key, value in reference_state.items():
                torch.testing.assert_close(rank[name]["state"][key], value, rtol=0, atol=0, msg=f"{name}.{key}")
            with torch.no_grad():
                want = expected[name](input_ids=input_ids).logits
            torch.testing.assert_close(rank[name]["logits"], want, rtol=1e-5, atol=1e-5)
            assert rank[name]["shard_dtypes"] == {torch.float32}
        for key, buffer in rank["policy"]["buffers"].items():  # e.g. rotary inv_freq, not in the state dict
            torch.testing.assert_close(buffer, dict(policy.named_buffers())[key], rtol=0, atol=0)
        # the frozen reference: bf16 shards, the checkpoint's weights rounded to bf16
        assert rank["reference"]["shard_dtypes"] == {torch.bfloat16}
        for key, value in policy.state_dict().items():
            assert rank["reference"]["state"][key].dtype == torch.bfloat16
            torch.testing.assert_close(rank["reference"]["state"][key], value.to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(ranks[0]["reference"]["logits"], ranks[1]["reference"]["logits"], rtol=0, atol=0)
