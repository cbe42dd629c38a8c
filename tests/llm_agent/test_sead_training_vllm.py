"""SEAD training with the policy generating through vLLM (``rollout.name=vllm``): the real trainer on Ray with 2
FSDP workers, each holding a vLLM engine, against two scripted simulator servers.

A run of two GRPO steps that checkpoints after each step is compared with a second run resumed from the step-1
checkpoint: right after the resume, vLLM's log-probs of the tokens it samples must equal the actor's (the
checkpoint's weights reached the engines; the initial weights would be measurably off), and the resumed step 2
must reproduce the first run's step 2 (its rollouts token for token, its loss and its final weights), which
also needs the vLLM sampling seeds to come from the restored RNG states. Needs the vLLM environment (``make vllm-env``).
"""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from tests.helpers.repo import SCENARIO_PATH
from tests.helpers.sead_training_run import PROMPTS, VLLM_ROLLOUT, make_trainer, training_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="needs vLLM: run with the vLLM environment's python (make vllm-env)")]

STEPS = 2


@pytest.fixture()
def sims(tmp_path):
    from tests.helpers.sim_servers import SimServers

    servers = SimServers(tmp_path)
    urls = [servers.start("--scenario", str(SCENARIO_PATH)) for _ in range(2)]
    try:
        servers.wait_ready(*urls)
        yield urls
    finally:
        servers.stop_all()


def _engine_gap(trainer, initial_model: str) -> tuple[float, float]:
    """(max |vLLM - actor| log-prob, mean |initial weights - actor| log-prob) over tokens vLLM samples now for
    random probe prompts: the first is ~0 only if the engine holds the actor's current weights."""
    from transformers import AutoModelForCausalLM

    from verl.protocol import DataProto

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 1000, (4, 12), generator=gen)
    mask = torch.ones_like(ids)
    probe = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask,
                                         "position_ids": torch.arange(12).expand(4, -1).clone()},
                                meta_info={"response_length": 8, "do_sample": True})
    out = trainer.actor_rollout_wg.generate_sequences(probe)
    actor = trainer.actor_rollout_wg.compute_log_prob(out).batch["old_log_probs"]
    tokens = out.batch["response_mask"].bool()
    model = AutoModelForCausalLM.from_pretrained(initial_model, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=out.batch["input_ids"], attention_mask=out.batch["attention_mask"],
                       position_ids=out.batch["position_ids"]).logits[:, -9:-1]
    initial = torch.log_softmax(logits, -1).gather(-1, out.batch["responses"].unsqueeze(-1)).squeeze(-1)
    return (float((out.batch["rollout_log_probs"] - actor).abs()[tokens].max()),
            float((initial - actor).abs()[tokens].mean()))


def _run(model: str, out, urls: list[str], extra: list[str], resumed: bool = False) -> tuple[dict, dict, tuple]:
    """Train (resuming as `extra` says) and return (metrics per step, rollout-log lines per step, engine gaps
    right after the checkpoint was loaded: see `_engine_gap`; None when not resumed)."""
    from omegaconf import OmegaConf

    config = training_config(model, out, urls, STEPS)
    config = OmegaConf.merge(config, OmegaConf.from_dotlist(VLLM_ROLLOUT + ["trainer.test_freq=-1"] + extra))
    trainer, pool = make_trainer(config)
    gaps = None
    try:
        trainer.init_workers()
        if resumed:  # fit() loads the checkpoint again, restoring the RNG states this probe used
            trainer.load_checkpoint()
            gaps = _engine_gap(trainer, model)
        trainer.fit()
    finally:
        trainer.shutdown()
        pool.remove()
    metrics = {m["step"]: m for m in map(json.loads, (out / "logs" / "metrics.jsonl").read_text().splitlines())}
    lines: dict[int, list] = {}
    for line in map(json.loads, (out / "rollouts.jsonl").read_text().splitlines()):
        lines.setdefault(line["step"], []).append(line)
    return metrics, lines, gaps


def _weights(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "actor" / "model.safetensors"))


@pytest.mark.extended  # 81 s measured: make test-extended (CI), out of make test's 20 minutes
def test_sead_training_with_vllm_rollout_checkpoints_and_resumes_exactly(warm_model_path, tiny_model_path, tmp_path,
                                                                           sims, ray_cluster):
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    metrics, lines, _ = _run(warm_model_path, first, sims, [])
    assert sorted(metrics) == [1, 2]
    for step in (1, 2):
        assert metrics[step]["dialogue/n_dialogues"] == PROMPTS * 4
        assert metrics[step]["timing_s/weight_sync"] > 0
        assert metrics[step]["rollout/weight_sync_mb"] > 0
    assert sum(t["user_source"] == "simulator" for line in lines[1] for t in line["turns"]) > 0

    # The resumed run names the untrained tiny model (the warm model's base, same tokenizer) as its model path,
    # so its engines start from weights far from the checkpoint's: only the sync after the load can fix that.
    again, again_lines, (synced_gap, stale_gap) = _run(tiny_model_path, resumed, sims, [
        "trainer.resume_mode=resume_path", f"trainer.resume_from_path={first / 'ckpt' / 'global_step_1'}",
        "trainer.resume_from_other_model=true"], resumed=True)
    assert synced_gap < 1e-4, f"vLLM is off the resumed actor by {synced_gap}: the checkpoint was not synced"
    assert stale_gap > 0.1, f"the model path's weights are too close to the checkpoint's ({stale_gap}) to tell"
    assert sorted(again) == [2], "the resumed run must start at step 2"
    assert [line["turns"] for line in again_lines[2]] == [line["turns"] for line in lines[2]]
    for key in ("actor/pg_loss", "actor/grad_norm", "response_length/mean", "reward/total/mean"):
        if key in metrics[2]:
            assert again[2][key] == pytest.approx(metrics[2][key], rel=1e-5, abs=1e-6), key
    first_w, again_w = _weights(first / "ckpt" / "global_step_2"), _weights(resumed / "ckpt" / "global_step_2")
    for name in first_w:
        assert torch.allclose(first_w[name], again_w[name], atol=1e-6, rtol=0), name
