"""Local evaluation agents: which directory a spec names, which engine generates, and a trainer checkpoint saved
without its HF export (weights read from its sharded state)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import llm_agent.evaluation.local_agents as local_agents
from llm_agent.evaluation.agents import AgentSpec
from llm_agent.evaluation.local_agents import HFRolloutAgent, load_policy_model, pick_engine, resolve_model_dir
from verl.protocol import DataProto

from tests.helpers.checkpoint_fixtures import write_checkpoint
from tests.helpers.for_evaluation_cli import load_script


def test_model_directories_resolve_to_the_actor_export(tiny_model_path, tmp_path):
    ckpt = tmp_path / "ckpt"
    for step in (1, 2):
        (ckpt / f"global_step_{step}" / "actor").mkdir(parents=True)
        (ckpt / f"global_step_{step}" / "actor" / "config.json").write_text("{}")
        (ckpt / f"global_step_{step}" / "trainer_state.json").write_text(f'{{"global_step": {step}}}')  # complete
    (ckpt / "global_step_3.partial" / "actor").mkdir(parents=True)  # an interrupted save: ignored
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    assert resolve_model_dir(tiny_model_path) == type(ckpt)(tiny_model_path)
    assert resolve_model_dir(ckpt) == ckpt / "global_step_2" / "actor"
    assert resolve_model_dir(ckpt / "global_step_1") == ckpt / "global_step_1" / "actor"
    with pytest.raises(ValueError, match="not a model directory"):
        resolve_model_dir(tmp_path / "nothing")
    with pytest.raises(ValueError, match=r"global_step_1/actor: no model weights .* and no sharded_state/"):
        load_policy_model(ckpt / "global_step_1" / "actor", torch.float32)


@pytest.mark.parametrize("installed", [True, False])
def test_the_engine_is_vllm_when_installed_unless_chosen(monkeypatch, installed):
    monkeypatch.setattr(local_agents, "vllm_available", lambda: installed)
    assert pick_engine("auto") == ("vllm" if installed else "hf")
    assert pick_engine("hf") == "hf"
    if installed:
        assert pick_engine("vllm") == "vllm"
    else:
        with pytest.raises(ValueError, match=r"vLLM is not installed .*\(make vllm-env"):
            pick_engine("vllm")
    with pytest.raises(ValueError, match="engine must be one of"):
        pick_engine("tgi")


def test_evaluate_refuses_an_unavailable_engine_before_starting_simulators(monkeypatch, tiny_model_path, tmp_path):
    monkeypatch.setattr(local_agents, "vllm_available", lambda: False)
    evaluate = load_script("evaluate")
    with pytest.raises(SystemExit, match="evaluate: engine vllm: vLLM is not installed"):
        evaluate.main(["--agent", tiny_model_path, "--engine", "vllm", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out" / "user_sims").exists(), "no simulator may be started for a refused run"


def test_results_name_the_engine_of_local_agents_only():
    assert AgentSpec.parse("rl=ckpt/global_step_3").describe("vllm") == "ckpt/global_step_3 (vllm)"
    assert AgentSpec.parse("http://127.0.0.1:8000").describe("vllm") == "http://127.0.0.1:8000"
    assert AgentSpec.parse("scripted:good").describe("hf") == "scripted:good"


@pytest.mark.processes
def test_a_checkpoint_without_hf_export_generates_from_its_sharded_state(tiny_model_path, tmp_path):
    step = write_checkpoint(tiny_model_path, tmp_path / "ckpt", step=4, hf_export=False)
    actor = step / "actor"
    assert not list(actor.glob("*.safetensors")) and (actor / "sharded_state").is_dir()
    assert resolve_model_dir(tmp_path / "ckpt") == actor

    source = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).state_dict()
    loaded = load_policy_model(actor, torch.float32).state_dict()
    assert set(loaded) == set(source)
    for name, value in source.items():
        assert torch.equal(loaded[name], value), name

    from_ckpt, from_dir = HFRolloutAgent(tmp_path / "ckpt", device="cpu"), HFRolloutAgent(tiny_model_path, device="cpu")
    ids = torch.randint(4, 500, (3, 7), generator=torch.Generator().manual_seed(0))
    prompts = DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids),
                 "position_ids": torch.arange(7).expand(3, -1).clone()},
        meta_info={"response_length": 6, "do_sample": False, "eos_token_id": from_dir.tokenizer.eos_token_id,
                   "pad_token_id": from_dir.tokenizer.pad_token_id})
    got = from_ckpt.generate_sequences(prompts).batch["responses"]
    assert torch.equal(got, from_dir.generate_sequences(prompts).batch["responses"])
