"""``python -m verl.trainer.trace_preset``: the GPU presets traced at full size on CPU agree with the planner, and a
broken wrapping (a decoder layer left out of FSDP, a dtype left in fp32) is caught.

The full-size traces (Qwen2.5-7B and -14B configs shipped in tests/data/models, no weights) take a minute or two of
CPU each: all three are extended (make test-extended, kept out of make test's 20 minutes; CI runs them); the small
model (four decoder layers) runs the same code paths in seconds: padded and packed rows, with and without
checkpointing, LoRA, the critic, the CLI and the broken wrappings.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import verl.utils.fsdp_utils as fsdp_utils
import verl.workers.fsdp_models as fsdp_models
from verl.trainer.trace_models import fake_world
from verl.trainer.trace_preset import main, trace_preset
from verl.utils.memory_trace import GATHERED, GRADIENTS, WEIGHTS

from tests.helpers.plan_presets import PRESET_GPU

pytestmark = pytest.mark.usefixtures("no_process_group")
MODELS = Path(__file__).resolve().parents[2] / "data" / "models"
LORA_PRESET = ["actor_rollout_ref.model.lora_rank=32", "actor_rollout_ref.model.lora_alpha=32",
               "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.gpu_memory_utilization=0.7"]
# the small model's sequences: 256 prompt + 768 response tokens, update micro-batches of two of them
SMALL_SHAPES = ["data.max_prompt_length=256", "data.max_response_length=768",
                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048",
                "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=4096",
                "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=4096", "rollout_loop.config.max_turns=3"]


def _trace(model_dir, *extra):
    return trace_preset([f"actor_rollout_ref.model.path={model_dir}", *PRESET_GPU, *extra], "sead_trainer")


@pytest.fixture()
def small_model(tmp_path):
    """A four-layer Qwen2.5 (hidden 1024, vocabulary 4096): the 7B config with smaller sizes."""
    config = json.loads((MODELS / "qwen2.5-7b-instruct" / "config.json").read_text())
    config.update(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, max_window_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=4096)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _agrees(result):
    assert not result.report.differences, result.report.format()


@pytest.mark.slow
@pytest.mark.extended
def test_qwen25_7b_full_fine_tuning_on_6_ranks_agrees_with_the_planner():
    result = _trace(MODELS / "qwen2.5-7b-instruct")
    _agrees(result)
    trace, params = result.trace, 7_615_616_512
    assert [p.name for p in trace.phases] == ["old log-probs", "reference log-probs", "update actor", "weight sync"]
    # rank 1's shards: the actor's fp32 master weights, the reference's bf16 copy (offloaded outside its phase)
    assert trace["reference log-probs"].dtypes[WEIGHTS] == pytest.approx(
        {"fp32": 4 * params / 6, "bf16": 2 * params / 6}, rel=0.01)
    assert set(trace["update actor"].dtypes[WEIGHTS]) == {"fp32"}
    assert trace["update actor"].dtypes[GRADIENTS] == pytest.approx({"fp32": 4 * params / 6}, rel=0.01)
    # FSDP2 gathers every unit once per forward (28 layers, embedding, head, root) and reduce-scatters fp32 gradients
    counts = trace["update actor"].collective_counts()
    assert sum(n for c, n in counts.items() if c.kind == "all_gather" and c.dtype == "bf16") == 2 * 31
    assert sum(n for c, n in counts.items() if c.kind == "reduce_scatter" and c.dtype == "fp32") == 31
    sync = trace["weight sync"]
    assert sum(c.nbytes for c in sync.collectives) == pytest.approx(2 * params, rel=0.01)  # every weight in bf16
    assert max(c.nbytes for c in sync.collectives) == 152064 * 3584 * 2  # the embedding is a bucket of its own


@pytest.mark.extended
def test_qwen25_14b_full_fine_tuning_on_6_ranks_agrees_with_the_planner():
    result = _trace(MODELS / "qwen2.5-14b-instruct")
    _agrees(result)
    update = result.trace["update actor"]
    assert set(update.dtypes[GATHERED]) <= {"bf16", "fp32"}  # gathered bf16, reduce-scatter buffers fp32
    assert update.total > result.trace["old log-probs"].total


@pytest.mark.extended
def test_qwen25_14b_lora_on_2_ranks_agrees_with_the_planner():
    result = _trace(MODELS / "qwen2.5-14b-instruct", *LORA_PRESET)
    _agrees(result)
    trace, adapter = result.trace, 48 * 32 * (10240 + 6144 + 6144 + 10240 + 3 * 18944)
    # the frozen base in bf16 beside the fp32 adapter; the reference pass is the actor's (no second copy)
    assert trace["update actor"].dtypes[WEIGHTS]["fp32"] == pytest.approx(4 * adapter / 2, rel=0.01)
    assert trace["reference log-probs"].peak[WEIGHTS] == trace["old log-probs"].peak[WEIGHTS]
    counts = trace["update actor"].collective_counts()
    assert sum(n for c, n in counts.items() if c.kind == "reduce_scatter") == 48  # the layers' adapters only
    assert [c.nbytes for c in trace["weight sync"].collectives] == [2 * adapter]  # the adapter alone, one bucket


@pytest.mark.oldest
@pytest.mark.parametrize("extra", [
    [],  # the preset: packed rows, checkpointing, the reference offloaded
    ["actor_rollout_ref.model.use_remove_padding=false", "actor_rollout_ref.model.enable_gradient_checkpointing=false",
     "actor_rollout_ref.ref.fsdp_config.param_offload=false"],
    [*LORA_PRESET, "actor_rollout_ref.model.lora_rank=8"],
    # the critic packs its rows while the actor pads them: each model switches its own attention
    ["algorithm.adv_estimator=gae", "critic.model.use_remove_padding=true", "actor_rollout_ref.rollout.name=hf",
     "actor_rollout_ref.model.use_remove_padding=false"],
], ids=["preset", "padded-no-checkpointing", "lora", "packed-critic-padded-actor-hf"])
def test_small_model_agrees_with_the_planner(small_model, extra):
    result = _trace(small_model, *SMALL_SHAPES, *extra)
    _agrees(result)
    if "algorithm.adv_estimator=gae" in extra:
        assert {"values (critic)", "update critic"} <= {p.name for p in result.trace.phases}


@pytest.mark.oldest
def test_a_decoder_layer_left_unwrapped_is_caught(small_model, monkeypatch):
    layers = fsdp_utils.transformer_layer_modules
    monkeypatch.setattr(fsdp_utils, "transformer_layer_modules", lambda model: layers(model)[:-1])
    differences = _trace(small_model, *SMALL_SHAPES).report.differences
    # one all-gather fewer per pass (the layer rides in the root unit), a larger gathered root
    assert "old log-probs: all_gather bf16 planned 7 (" in " ".join(differences)
    assert any("update actor: reduce_scatter fp32 planned 7" in d for d in differences)


@pytest.mark.oldest
def test_a_reference_left_in_fp32_is_caught(small_model, monkeypatch):
    monkeypatch.setattr(fsdp_models, "compute_dtype", lambda section, device: torch.float32)  # no bf16 master
    differences = _trace(small_model, *SMALL_SHAPES).report.differences
    assert any(d.startswith("reference log-probs: weights planned") for d in differences), differences


@pytest.mark.oldest
def test_units_gathered_in_fp32_are_caught(small_model, monkeypatch):
    policy = fsdp_utils.MixedPrecisionPolicy
    monkeypatch.setattr(fsdp_utils, "MixedPrecisionPolicy",
                        lambda param_dtype, **kwargs: policy(param_dtype=None, **kwargs))  # no cast: fp32 units
    differences = " ".join(_trace(small_model, *SMALL_SHAPES).report.differences)
    assert "update actor: all_gather fp32 planned 0 (0.00 GB), traced 14" in differences
    assert "old log-probs: gathered units planned" in differences


@pytest.mark.oldest
def test_cli_prints_the_report_and_exits_1_on_a_difference(small_model, monkeypatch, capsys):
    args = ["--config-name", "sead_trainer", f"actor_rollout_ref.model.path={small_model}", *PRESET_GPU,
            *SMALL_SHAPES]
    main(args)
    out = capsys.readouterr().out
    assert "trace and plan agree within 10% on every line item" in out and "weight sync: " in out
    layers = fsdp_utils.transformer_layer_modules
    monkeypatch.setattr(fsdp_utils, "transformer_layer_modules", lambda model: layers(model)[1:])
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 1 and "line item(s) differ" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="config.json"):
        main(["actor_rollout_ref.model.path=/nonexistent"])


@pytest.mark.oldest
def test_a_weightless_build_needs_fsdp2(small_model):
    with fake_world(2) as mesh, pytest.raises(ValueError, match="load_weights=False needs the fsdp2 strategy"):
        fsdp_utils.build_fsdp_model(AutoModelForCausalLM, str(small_model), mesh, {}, seed=1, strategy="fsdp",
                                    load_weights=False)
