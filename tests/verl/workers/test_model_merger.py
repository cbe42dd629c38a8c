"""Checkpoints without the HF export (trainer.save_hf_model=last|never) and `python -m verl.model_merger`, which
exports the HF model from the sharded state afterwards; the export is in the training dtype unless --dtype asks,
and its weight files have the mode of the files beside them."""
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


@pytest.mark.extended  # 23-27 s measured: make test-extended (CI), out of make test's 20 minutes
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
    for name, dtype in (("hf_default", []), ("hf_bf16", ["--dtype", "bf16"])):
        proc = subprocess.run([sys.executable, "-m", "verl.model_merger", "--local_dir", str(ckpt), "--target_dir",
                               str(tmp_path / name), *dtype], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr
        _assert_modes_like_the_rest(tmp_path / name)
    # no --dtype: the training dtype (float32 master weights), exactly what was trained (bf16 was the default)
    assert _safetensors_dtypes(tmp_path / "hf_default") == {torch.float32}
    default = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_default", dtype=torch.float32).state_dict()
    assert all(torch.equal(default[name], value) for name, value in trained.items())
    assert _safetensors_dtypes(tmp_path / "hf_bf16") == {torch.bfloat16}
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_bf16", dtype=torch.bfloat16).state_dict()
    for name, value in trained.items():
        assert torch.equal(bf16[name], value.to(torch.bfloat16)), name

    bad = subprocess.run([sys.executable, "-m", "verl.model_merger", "--local_dir", str(tmp_path),
                          "--target_dir", str(tmp_path / "x")], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 1 and "config.json is missing" in bad.stderr


def _assert_modes_like_the_rest(directory: Path) -> None:
    """Every file of an export has the mode of its config.json (0644 under umask 022; save_pretrained's weights
    file was 0600)."""
    expected = (directory / "config.json").stat().st_mode & 0o777
    modes = {p.name: p.stat().st_mode & 0o777 for p in directory.iterdir() if p.is_file()}
    assert modes and all(mode == expected for mode in modes.values()), modes
    assert expected == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_hf_export_is_in_the_training_dtype(tiny_model_path, tmp_path):
    worker = _trained_worker(tiny_model_path, "bf16")
    ckpt = tmp_path / "actor"
    worker.save_checkpoint(str(ckpt), global_step=1)
    assert (ckpt / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~_umask()  # not save_pretrained's 0600
    assert _safetensors_dtypes(ckpt) == {torch.bfloat16}
    exported = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).state_dict()
    for name, value in full_state_dict(worker.actor.actor_module).items():
        assert torch.equal(exported[name], value.to(torch.bfloat16)), name


def _small_adapter(base: str, directory: Path) -> Path:
    """A LoRA adapter on the tiny model whose change is small, as a few steps at a small learning rate leave it:
    B = 1e-4 * noise (PEFT initialises B to 0), A as PEFT draws it."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(r=8, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(1e-4 * torch.randn_like(param))
    model.save_pretrained(str(directory))
    return directory


def test_a_merged_lora_export_keeps_what_the_adapter_changed(tiny_model_path, tmp_path, caplog):
    import logging

    from peft import PeftModel

    adapter = _small_adapter(tiny_model_path, tmp_path / "adapter")
    def logits(model: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return model.eval()(ids).logits

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    ids = torch.randint(3, base.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    base_logits = logits(base)
    reference = logits(PeftModel.from_pretrained(base, adapter))  # base + adapter, float32
    effect = float((reference - base_logits).abs().max())
    assert effect > 1e-5
    out = merge(adapter, tmp_path / "merged")  # the default: float32, as trained
    _assert_modes_like_the_rest(out)
    merged = logits(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32))
    assert float((merged - reference).abs().max()) < 1e-3 * effect  # all of the adapter's effect is there
    with caplog.at_level(logging.WARNING, logger="verl.model_merger"):
        merge(adapter, tmp_path / "merged_bf16", dtype="bf16")
    assert any("the export blurs what the adapter learnt" in r.getMessage() for r in caplog.records)
    with torch.no_grad():  # what the warning is about: bf16 rounding is larger than the adapter's effect
        bf16 = logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged_bf16", dtype=torch.float32))
    assert float((bf16 - reference).abs().max()) > effect
