"""FSDP2 units: every decoder layer, the input embedding and the (untied) LM head are units of their own, and a
2-rank gloo update with that wrapping equals the single-process update."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from verl.utils.optim import build_optimizer
from verl.workers.actor.dp_actor import DataParallelPPOActor

from tests.helpers.ppo_batch_helpers import actor_config, make_ppo_batch

pytestmark = pytest.mark.slow

ROWS = 8


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def untied_model_path(tiny_model_path, tmp_path_factory):
    """The tiny model with a separate LM head (the embedding plus noise)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    untied = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    state = model.state_dict()
    torch.manual_seed(3)
    state["lm_head.weight"] = state["model.embed_tokens.weight"] + 0.02 * torch.randn_like(state["lm_head.weight"])
    untied.load_state_dict(state)
    out = tmp_path_factory.mktemp("untied_model")
    untied.save_pretrained(out)
    for name in os.listdir(tiny_model_path):
        if "token" in name or name.endswith(".jinja"):
            (out / name).write_bytes((open(os.path.join(tiny_model_path, name), "rb")).read())
    return str(out)


def _rank_main(rank: int, model_path: str, tied_path: str, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.fsdp import FSDPModule

    from verl.utils.fsdp_utils import build_fsdp_model, create_device_mesh, full_state_dict

    mesh = create_device_mesh("cpu")
    tied = build_fsdp_model(AutoModelForCausalLM, tied_path, mesh, {}, seed=1)
    model = build_fsdp_model(AutoModelForCausalLM, model_path, mesh, {}, seed=1)
    structure = {
        "untied_embedding_unit": isinstance(model.model.embed_tokens, FSDPModule),
        "untied_head_unit": isinstance(model.lm_head, FSDPModule),
        "layer_units": all(isinstance(layer, FSDPModule) for layer in model.model.layers),
        "tied_embedding_unit": isinstance(tied.model.embed_tokens, FSDPModule),
        "tied_head_unit": isinstance(tied.lm_head, FSDPModule),
        "root_params": sorted(n for n, _ in model.named_parameters()
                              if not any(n.startswith(p) for p in ("model.layers.", "model.embed_tokens", "lm_head"))),
    }
    cfg = actor_config(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=1)
    actor = DataParallelPPOActor(cfg, model, build_optimizer(model.parameters(), cfg.optim))
    data = make_ppo_batch(ROWS, vocab_size=1024, seed=5)
    actor.update_policy(data.select_idxs(list(range(4 * rank, 4 * rank + 4))))
    state = {k: v.clone() for k, v in full_state_dict(model).items()}
    if rank == 0:
        torch.save({"structure": structure, "state": state}, os.path.join(out_dir, "result.pt"))
    dist.barrier()
    dist.destroy_process_group()


def test_embedding_and_head_units_and_two_rank_update(untied_model_path, tiny_model_path, tmp_path):
    mp.start_processes(_rank_main, args=(untied_model_path, tiny_model_path, _free_port(), str(tmp_path)), nprocs=2,
                       join=True, start_method="spawn")
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    structure = result["structure"]
    assert structure["untied_embedding_unit"] and structure["untied_head_unit"] and structure["layer_units"]
    assert not structure["tied_embedding_unit"] and not structure["tied_head_unit"]  # one parameter: the root keeps it
    assert structure["root_params"] == ["model.norm.weight"]

    # the same two mini-batches in one process: rank r's k-th mini-batch is rows 4r+2k, 4r+2k+1
    data = make_ppo_batch(ROWS, vocab_size=1024, seed=5).select_idxs([0, 1, 4, 5, 2, 3, 6, 7])
    model = AutoModelForCausalLM.from_pretrained(untied_model_path, dtype=torch.float32)
    cfg = actor_config(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2)
    DataParallelPPOActor(cfg, model, build_optimizer(model.parameters(), cfg.optim)).update_policy(data)
    initial = AutoModelForCausalLM.from_pretrained(untied_model_path, dtype=torch.float32).state_dict()
    assert not torch.equal(initial["lm_head.weight"], model.state_dict()["lm_head.weight"])
    for name, value in model.state_dict().items():
        torch.testing.assert_close(result["state"][name], value, rtol=1e-5, atol=1e-5, msg=name)
