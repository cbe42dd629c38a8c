"""The planner with LoRA: hand-computed adapter sizes and states at 14B, no reference copy, the vLLM engine's adapter
slot and the adapter-only sync, unknown module names and the FLOPs of a frozen base (its memory against the
profiler: tests/verl/utils/test_memory_model_lora.py)."""
from __future__ import annotations

import pytest

from verl.trainer import plan_phases, plan_setup
from verl.trainer.config_schema import ConfigError, compose_config
from verl.trainer.config_validation import build_config
from verl.utils.memory_model import ModelShape, pass_flops

from tests.helpers.plan_presets import P_14B, QWEN25_14B, preset_phases

LORA_32 = ["actor_rollout_ref.model.lora_rank=32", "actor_rollout_ref.model.lora_alpha=32"]
# rank 32 on all seven linear layers of each of 48 layers: r x (in + out), in + out = q 10240, k 6144, v 6144,
# o 10240, gate 18944, up 18944, down 18944
ADAPTER_14B = 48 * 32 * (10240 + 6144 + 6144 + 10240 + 3 * 18944)


def test_lora_states_are_hand_computed_and_the_reference_is_the_actor(model_14b):
    setup, hw, phases = preset_phases(model_14b, [*LORA_32, "trainer.n_gpus_per_node=2"])
    assert setup.actor_lora.params == ADAPTER_14B == 137_625_600
    update = phases["update actor"]
    assert update.memory["weights"] == pytest.approx((2 * P_14B + 4 * ADAPTER_14B) / 2, rel=1e-6)  # bf16 base
    assert update.memory["optimizer"] == pytest.approx(8 * ADAPTER_14B / 2, rel=1e-6)
    assert update.memory["gradients"] == pytest.approx(4 * ADAPTER_14B / 2, rel=1e-6)
    # no second copy of the base: the reference pass computes with the actor's own state
    assert phases["reference log-probs"].memory["weights"] == phases["old log-probs"].memory["weights"]
    _, _, full = preset_phases(model_14b, ["trainer.n_gpus_per_node=2"])
    assert full["reference log-probs"].memory["weights"] > full["old log-probs"].memory["weights"]
    # the engine: bf16 weights over TP 2 plus one adapter slot for every linear layer at max_lora_rank 32
    engine = plan_phases.vllm_engine(setup, hw)
    assert engine.weights == pytest.approx(2 * P_14B / 2 + 2 * ADAPTER_14B / 2)
    sync = phases["weight sync"]
    # the adapter's factors, one bucket of 275 MB in bf16: its two shards, the gathered buffer and the copies held whole
    assert sync.memory["gathered units"] == 3 * 2 * ADAPTER_14B
    assert sync.seconds == pytest.approx(engine.weights / 25e9 + 2 * ADAPTER_14B / 3.35e12)
    assert max(p.total for p in phases.values()) <= hw.memory_bytes  # 14B with LoRA fits 2 GPUs of 80 GB
    assert max(p.total for p in full.values()) > hw.memory_bytes  # full fine-tuning does not


def test_split_placement_with_lora_exports_the_adapter_alone_to_an_engine_with_its_slot(model_14b):
    split = [*LORA_32, "trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.n_gpus_per_node=2"]
    setup, hw, phases = preset_phases(model_14b, split)
    export = phases["weight export"]
    # rank 0 copies the bf16 adapter to host memory, each rollout GPU reads it back
    assert export.seconds == pytest.approx(2 * ADAPTER_14B / (hw.host_gbps * 1e9)) == phases["weight install"].seconds
    assert "the adapter" in export.notes[0]
    _, _, colocated = preset_phases(model_14b, [*LORA_32, "trainer.n_gpus_per_node=4"])  # the same gather
    assert export.memory["gathered units"] == colocated["weight sync"].memory["gathered units"]
    engine = plan_phases.vllm_engine(plan_phases.rollout_side(setup), hw)  # on its own GPUs, with its adapter slot
    assert engine.weights == pytest.approx(2 * P_14B / 2 + 2 * ADAPTER_14B / 2)
    _, _, merged = preset_phases(model_14b, [*split, "actor_rollout_ref.model.lora.merge=true"])
    assert merged["weight export"].seconds == pytest.approx(2 * P_14B / (hw.host_gbps * 1e9))


def test_target_and_excluded_modules_and_merged_sync(model_14b):
    setup, _, phases = preset_phases(model_14b, [*LORA_32, "actor_rollout_ref.model.target_modules=[q_proj,v_proj]",
                                                  "actor_rollout_ref.model.lora.merge=true"])
    assert setup.actor_lora.params == 48 * 32 * (10240 + 6144)
    _, _, full = preset_phases(model_14b)  # merged: every weight, in the full model's buckets
    assert phases["weight sync"].memory["gathered units"] == full["weight sync"].memory["gathered units"]
    setup, _, _ = preset_phases(model_14b, [*LORA_32, "actor_rollout_ref.model.exclude_modules=[down_proj]"])
    assert setup.actor_lora.params == ADAPTER_14B - 48 * 32 * 18944
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.model.target_modules: \['qkv_proj'\] name no linear "
                                          r"layer of the model's decoder layers"):
        preset_phases(model_14b, [*LORA_32, "actor_rollout_ref.model.target_modules=[q_proj,qkv_proj]"])
    with pytest.raises(ConfigError, match="exclude_modules removes every target module"):
        preset_phases(model_14b, [*LORA_32, "actor_rollout_ref.model.target_modules=[q_proj]",
                                   "actor_rollout_ref.model.exclude_modules=[q_proj]"])


def test_critic_lora_state_counts_its_value_head(model_14b):
    cfg = build_config(compose_config([f"actor_rollout_ref.model.path={model_14b}", "algorithm.adv_estimator=gae",
                                       "critic.model.lora_rank=16", "trainer.n_gpus_per_node=2"], "sead_trainer"))
    shape = ModelShape.from_hf_config(QWEN25_14B)
    setup = plan_setup.make_setup(cfg, shape, shape)
    trained = 48 * 16 * (10240 + 6144 + 6144 + 10240 + 3 * 18944) + 5120 + 1
    critic = plan_phases.update_phase(setup, plan_setup.Hardware(), "critic", 1, True)
    assert critic.memory["gradients"] == pytest.approx(4 * trained / 2, rel=1e-6)


def test_frozen_base_flops():
    shape = ModelShape.from_hf_config(QWEN25_14B)
    full = pass_flops(shape, [4096, 2048], 3000, checkpointing=True)
    lora = pass_flops(shape, [4096, 2048], 3000, checkpointing=True, lora_params=ADAPTER_14B)
    adapter = 2.0 * ADAPTER_14B * 6144
    assert lora.adapter == adapter and lora.dense_forward == full.dense_forward
    # the base's matmuls: forward + input gradients; attention and the adapters: forward + 2 x backward
    assert lora.model == pytest.approx(2 * full.dense_forward + 3 * (full.attention_forward + adapter))
    assert lora.hardware == pytest.approx(lora.model + full.recompute_forward + adapter)
    # saved: the base's weight gradients (1 x its matmuls) less the adapters' forward, backward and recompute
    assert full.hardware - lora.hardware == pytest.approx(full.dense_forward - 4 * adapter)
    assert lora.hardware < 0.8 * full.hardware
