"""HF generation on an FSDP2 model over 2 gloo ranks: the weights are all-gathered once per generate_sequences
call (not once per decoded token), the outputs equal a single unsharded process, and afterwards the model is
resharded and gathers per forward again."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl.workers.rollout.hf_rollout import HFRollout

from tests.helpers.ppo_batch_helpers import make_prompts

pytestmark = pytest.mark.slow

ROWS_PER_RANK = 4


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rollout_config(response_length: int):
    return OmegaConf.create({"do_sample": False, "response_length": response_length, "micro_batch_size_per_gpu": 2})


def _prompts(tokenizer):
    prompts = make_prompts(2 * ROWS_PER_RANK, vocab_size=1024, seed=6)
    prompts.meta_info.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return prompts


def _rank_main(rank: int, model_path: str, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from verl.utils.fsdp_utils import build_fsdp_model, create_device_mesh

    gathers = {"count": 0}
    original = dist.all_gather_single

    def counting_all_gather(*args, **kwargs):
        gathers["count"] += 1
        return original(*args, **kwargs)

    dist.all_gather_single = counting_all_gather  # FSDP2's all-gather (DefaultAllGather) looks it up here
    model = build_fsdp_model(AutoModelForCausalLM, model_path, create_device_mesh("cpu"), {}, seed=1)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = _prompts(tokenizer)
    rows = prompts.select_idxs(list(range(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)))
    result = {"units": sum(isinstance(m, FSDPModule) for m in model.modules()), "gathers": {}, "responses": {}}
    for response_length in (3, 12):
        gathers["count"] = 0
        out = HFRollout(model, _rollout_config(response_length)).generate_sequences(rows)
        result["gathers"][response_length] = gathers["count"]
        result["responses"][response_length] = out.batch["responses"]
    result["resharded"] = all(isinstance(p, DTensor) for p in model.parameters())
    per_forward = []
    with torch.no_grad():
        for _ in range(2):
            gathers["count"] = 0
            model(input_ids=rows.batch["input_ids"], attention_mask=rows.batch["attention_mask"])
            per_forward.append(gathers["count"])
    result["per_forward"] = per_forward
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def test_generation_gathers_once_and_matches_a_single_process(tiny_model_path, tmp_path):
    mp.start_processes(_rank_main, args=(tiny_model_path, _free_port(), str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    prompts = _prompts(AutoTokenizer.from_pretrained(tiny_model_path))
    for response_length in (3, 12):
        expected = HFRollout(model, _rollout_config(response_length)).generate_sequences(prompts)
        sharded = torch.cat([r["responses"][response_length] for r in ranks])
        assert torch.equal(sharded, expected.batch["responses"]), response_length
    for rank in ranks:
        # one all-gather per FSDP unit per generate_sequences call (2 micro-batches), whatever the length
        assert rank["gathers"][3] == rank["gathers"][12] == rank["units"]
        assert rank["resharded"]
        # reshard_after_forward is back on: every forward gathers again
        assert rank["per_forward"][0] == rank["per_forward"][1] > 0
