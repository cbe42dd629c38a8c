"""Checkpoints without the HF export (trainer.save_hf_model=last|never) and `python -m verl.model_merger`, which
exports the HF model from the sharded state afterwards; the export is in the training dtype."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from verl.model_merger import merge
from verl.utils.fsdp_utils import full_state_dict
from verl.workers.fsdp_workers import ActorRolloutRefWorker

from tests.helpers.ppo_batch_helpers import RESPONSE_LEN, actor_rollout_ref_config, make_prompts

pytestmark = [pytest.mark.processes, pytest.mark.oldest]  # oldest: also under transformers 5.17
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module", autouse=True)
def single_rank_process_group():
    """The workers join a world-size-1 gloo group in this process; tear it down after the module."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _trained_worker(model_path: str, param_dtype: str) -> ActorRolloutRefWorker:
    cfg = actor_rollout_ref_config(model_path, fsdp_config={"param_dtype": param_dtype, "reshard_after_forward": True})
    worker = ActorRolloutRefWorker(cfg, role="actor_rollout_ref")
    worker.init_model()
    gen = worker.generate_sequences(make_prompts(8, worker.tokenizer.vocab_size, seed=3))
    gen = gen.union(worker.compute_log_prob(gen)).union(worker.compute_ref_log_prob(gen))
    gen.batch["advantages"] = torch.randn(8, RESPONSE_LEN) * gen.batch["response_mask"]
    worker.update_actor(gen)
    return worker


def _safetensors_dtypes(directory: Path) -> set[torch.dtype]:
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return {f.get_tensor(k).dtype for k in f.keys()}


def test_no_hf_export_then_the_merger_writes_the_same_weights(tiny_model_path, tmp_path):
    worker = _trained_worker(tiny_model_path, "auto")
    ckpt = tmp_path / "global_step_1" / "actor"
    worker.save_checkpoint(str(ckpt), global_step=1, save_hf_model=False)
    assert not (ckpt / "model.safetensors").exists() and (ckpt / "config.json").is_file()
    trained = {k: v.clone() for k, v in full_state_dict(worker.actor.actor_module).items()}

    out = merge(ckpt, tmp_path / "hf_fp32", dtype="fp32")
    state = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    for name, value in trained.items():
        assert torch.equal(state[name], value), name
    assert (out / "tokenizer_config.json").is_file()

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "verl.model_merger", "--local_dir", str(ckpt), "--target_dir",
                           str(tmp_path / "hf_bf16")], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert _safetensors_dtypes(tmp_path / "hf_bf16") == {torch.bfloat16}
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_bf16", dtype=torch.bfloat16).state_dict()
    for name, value in trained.items():
        assert torch.equal(bf16[name], value.to(torch.bfloat16)), name

    bad = subprocess.run([sys.executable, "-m", "verl.model_merger", "--local_dir", str(tmp_path),
                          "--target_dir", str(tmp_path / "x")], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 1 and "config.json is missing" in bad.stderr


def test_hf_export_is_in_the_training_dtype(tiny_model_path, tmp_path):
    worker = _trained_worker(tiny_model_path, "bf16")
    ckpt = tmp_path / "actor"
    worker.save_checkpoint(str(ckpt), global_step=1)
    assert _safetensors_dtypes(ckpt) == {torch.bfloat16}
    exported = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).state_dict()
    for name, value in full_state_dict(worker.actor.actor_module).items():
        assert torch.equal(exported[name], value.to(torch.bfloat16)), name
