"""``python -m verl.trainer.plan``: the per-phase table from the real config, hand-computed states, advice."""

from __future__ import annotations

import json
import math

import pytest

from verl.trainer import plan, plan_advice, plan_phases, plan_setup
from verl.trainer.config_schema import compose_config
from verl.trainer.config_validation import build_config
from verl.utils.memory_model import ModelShape, update_terms

from tests.helpers.plan_presets import P_14B, PRESET_GPU, QWEN25_14B, preset_phases

QWEN25_7B = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
             "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
             "tie_word_embeddings": False}
P_7B = 7_615_616_512
SEAD_GPU = ["data.train_batch_size=60", "actor_rollout_ref.rollout.n=8", "trainer.n_gpus_per_node=6",
            "data.max_prompt_length=3584", "data.max_response_length=6144",
            "actor_rollout_ref.actor.ppo_mini_batch_size=60", "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2", "rollout_loop.config.max_turns=15",
            "rollout_loop.config.max_tokens_per_turn=256"]


@pytest.fixture()
def model_7b(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_7B))
    return str(tmp_path)


def _phases(model_dir, extra):
    cfg = build_config(compose_config([f"actor_rollout_ref.model.path={model_dir}", *SEAD_GPU, *extra],
                                      "sead_trainer"))
    critic = ModelShape.from_hf_config(QWEN25_7B) if cfg.need_critic else None
    setup = plan_setup.make_setup(cfg, ModelShape.from_hf_config(QWEN25_7B), critic)
    hw = plan_setup.Hardware()
    phases = plan_phases.build_phases(setup, hw)
    return setup, hw, {p.name.split(" (")[0]: p for p in phases}


def test_sharded_states_are_hand_computed(model_7b):
    setup, _, phases = _phases(model_7b, ["actor_rollout_ref.model.enable_gradient_checkpointing=true"])
    assert setup.rows_per_gpu == 80 and setup.seq_len == 9728
    update = phases["update actor"]
    # fp32 actor master shards + bf16 reference shards, AdamW's two fp32 moments, fp32 gradients, over 6 GPUs
    assert update.memory["weights"] == pytest.approx((4 + 2) * P_7B / 6, rel=1e-6)
    assert update.memory["optimizer"] == pytest.approx(8 * P_7B / 6, rel=1e-6)
    assert update.memory["gradients"] == pytest.approx(4 * P_7B / 6, rel=1e-6)
    # the rollout holds the whole policy in bf16 and the KV cache of 16 rows x 9728 tokens
    rollout = phases["rollout"]
    assert rollout.memory["gathered units"] == 2 * P_7B
    assert rollout.memory["kv cache"] == 16 * 9728 * 2 * 28 * 512 * 2
    assert set(phases) == {"rollout", "old log-probs", "reference log-probs", "update actor"}


def test_gae_adds_the_critic_process(model_7b):
    _, _, phases = _phases(model_7b, ["algorithm.adv_estimator=gae"])
    assert {"values", "update critic"} <= set(phases)
    critic_params = P_7B - 152064 * 3584 + 3584 + 1  # the value head replaces the LM head
    assert phases["update critic"].memory["gradients"] == pytest.approx(4 * critic_params / 6, rel=1e-6)
    assert phases["rollout"].memory["cuda contexts"] == 2 * plan_setup.CONTEXT_BYTES


def test_advice_turns_on_checkpointing_and_shrinks_micro_batches(model_7b):
    setup, hw, phases = _phases(model_7b, ["actor_rollout_ref.rollout.micro_batch_size_per_gpu=64"])
    assert phases["update actor"].total > hw.memory_bytes
    advice = plan_advice.advise(setup, hw, list(phases.values()))
    assert any("enable_gradient_checkpointing=true" in a for a in advice)
    rollout_advice = [a for a in advice if "rollout.micro_batch_size_per_gpu=" in a]
    assert len(rollout_advice) == 1
    fit = int(rollout_advice[0].split("micro_batch_size_per_gpu=")[1].split()[0])
    assert plan_phases.rollout_phase(setup, hw, fit).total <= hw.memory_bytes < plan_phases.rollout_phase(
        setup, hw, fit + 1).total


def test_cli_prints_every_phase_and_verdict(model_7b, capsys):
    plan.main(["--config-name", "sead_trainer", "--gpu-memory-gb", "80",
               f"actor_rollout_ref.model.path={model_7b}", *SEAD_GPU])
    out = capsys.readouterr().out
    assert "7.62B parameters" in out and "update actor" in out and "DOES NOT FIT" in out
    plan.main(["--config-name", "sead_trainer", f"actor_rollout_ref.model.path={model_7b}", *SEAD_GPU,
               "actor_rollout_ref.model.enable_gradient_checkpointing=true"])
    assert "fits in 80 GB" in capsys.readouterr().out


def test_cli_errors_name_the_problem(tmp_path):
    with pytest.raises(SystemExit, match="model.path is required"):
        plan.main([])
    with pytest.raises(SystemExit, match="config.json"):
        plan.main([f"actor_rollout_ref.model.path={tmp_path}"])
    with pytest.raises(SystemExit, match="not_a_key"):
        plan.main(["actor_rollout_ref.not_a_key=1"])


def test_fsdp1_generation_gathers_one_unit_at_a_time(model_7b):
    _, _, fsdp2 = _phases(model_7b, [])
    _, _, fsdp1 = _phases(model_7b, ["actor_rollout_ref.actor.strategy=fsdp"])
    assert fsdp2["rollout"].memory["gathered units"] == 2 * P_7B
    assert fsdp1["rollout"].memory["gathered units"] == fsdp1["old log-probs"].memory["gathered units"] < P_7B


def test_vllm_phase_holds_the_resident_actor_beside_the_engine_pool_and_counts_kv_tokens(model_14b):
    assert ModelShape.from_hf_config(QWEN25_14B).num_params() == P_14B
    setup, hw, phases = preset_phases(model_14b)
    rollout = phases["rollout"]
    assert rollout.name == "rollout (vLLM)"
    # fp32 actor shards and AdamW moments stay; the reference's bf16 shards are offloaded outside its phase
    assert rollout.memory["weights"] == pytest.approx(4 * P_14B / 6, rel=1e-6)
    assert rollout.memory["optimizer"] == pytest.approx(8 * P_14B / 6, rel=1e-6)
    assert rollout.memory["vllm"] == pytest.approx(0.55 * 80e9)
    assert phases["reference log-probs"].memory["weights"] == pytest.approx((4 + 2) * P_14B / 6, rel=1e-6)
    engine = plan_phases.vllm_engine(setup, hw)
    # KV per token on one GPU of a TP-2 engine: 2 (K, V) x 48 layers x 4 of the 8 KV heads x 128 x 2 bytes
    assert engine.kv_bytes_per_token == 2 * 48 * 4 * 128 * 2
    assert engine.weights == pytest.approx(2 * P_14B / 2)
    kv = 0.55 * 80e9 - engine.weights - engine.activations - engine.cuda_graphs - engine.other
    assert engine.kv_tokens == int(kv // (2 * 48 * 4 * 128 * 2))
    # 480 dialogues over 3 engines, each up to 2,048 + 6,144 tokens
    assert (engine.dialogues, engine.concurrent, engine.peak_tokens) == (160, 160, 160 * 8192)
    assert "KV cache" in rollout.notes[0] and f"{engine.kv_tokens:,} tokens" in rollout.notes[0]


def test_vllm_advice_names_the_engine_settings(model_14b):
    setup, hw, phases = preset_phases(model_14b)
    advice = plan_advice.advise(setup, hw, list(phases.values()))
    kv = [a for a in advice if a.startswith("rollout (vLLM): the KV cache holds")]
    assert len(kv) == 1 and "optimizer_offload=true" in kv[0] and "max_num_seqs=" in kv[0]
    assert not any("micro_batch_size_per_gpu" in a for a in advice)  # HF generate's key is not the vLLM rollout's
    # an engine pool that cannot sit beside the actor: lower gpu_memory_utilization to what fits
    setup, hw, phases = preset_phases(model_14b, ["actor_rollout_ref.rollout.gpu_memory_utilization=0.9"])
    assert phases["rollout"].total > hw.memory_bytes
    fix = [a for a in plan_advice.advise(setup, hw, list(phases.values())) if "does not fit beside" in a]
    util = float(fix[0].split("gpu_memory_utilization=")[1].split()[0])
    setup, hw, phases = preset_phases(model_14b, [f"actor_rollout_ref.rollout.gpu_memory_utilization={util}"])
    assert phases["rollout"].total <= hw.memory_bytes


def test_weight_sync_and_offload_phases(model_14b):
    setup, hw, phases = preset_phases(model_14b)
    sync = phases["weight sync"]
    # the embedding is a bucket of its own whose gathered buffer its yielded tensor keeps while the next bucket (layer
    # 0's q/k/v/o with biases, gate and up: 409 MB of the 512 MiB) is padded to 6 equal shards, concatenated,
    # gathered and copied out (the bf16 shards twice, the gathered buffer, the copies)
    params = [(5120, 5120), (5120, 1), (1024, 5120), (1024, 1), (1024, 5120), (1024, 1), (5120, 5120),
              (13824, 5120), (13824, 5120)]
    padded = sum(math.ceil(rows / 6) * 6 * cols for rows, cols in params) * 2
    full = sum(rows * cols for rows, cols in params) * 2
    assert sync.memory["gathered units"] == 152064 * 5120 * 2 + 2 * padded // 6 + padded + full
    engine_rest = plan_phases.VLLM_OTHER_BYTES + plan_phases.VLLM_CUDA_GRAPH_BYTES
    assert sync.memory["vllm"] == pytest.approx(P_14B + engine_rest)
    _, _, offloaded = preset_phases(model_14b, ["actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"])
    assert offloaded["rollout"].memory["optimizer"] == 0 and offloaded["update actor"].memory["optimizer"] > 0
    # a sleeping engine keeps its CUDA graphs; one that does not sleep keeps its whole pool
    assert phases["update actor"].memory["vllm"] == plan_phases.VLLM_OTHER_BYTES + plan_phases.VLLM_CUDA_GRAPH_BYTES
    _, _, awake = preset_phases(model_14b, ["actor_rollout_ref.rollout.free_cache_engine=false"])
    assert awake["update actor"].memory["vllm"] == pytest.approx(0.55 * 80e9)


def test_the_presets_token_budget_update_fits_at_14b_with_the_bf16_logits(model_14b):
    setup, hw, phases = preset_phases(model_14b)
    update = phases["update actor"]
    assert update.total <= hw.memory_bytes / 1.15  # the planner's 15% error, measured on CPU, fits too
    # one row of 8,192 tokens: the head's 6,145 response positions in bf16, kept and their gradient, and five fp32
    # chunks of the log-softmax's backward
    head = 6145 * 152064 * 2
    chunk = min(6144 * 152064 * 4, 2**24 * 4)
    terms = update_terms(setup.actor, 1, 8192, 6144, 2, True, head_positions=6145)
    assert terms.logits == 2 * head + 5 * chunk and terms.logits_grad == head


def test_cli_prints_the_vllm_phase(model_14b, capsys):
    plan.main(["--config-name", "sead_trainer", f"actor_rollout_ref.model.path={model_14b}", *PRESET_GPU])
    out = capsys.readouterr().out
    assert "rollout (vLLM)" in out and "weight sync (vLLM)" in out and "tokens;" in out and "fits in 80 GB" in out


def test_rollout_correction_costs_the_engine_a_log_softmax_and_bypass_drops_the_old_log_prob_pass(model_14b):
    setup, hw, phases = preset_phases(model_14b)
    without, _, _ = preset_phases(model_14b, ["actor_rollout_ref.rollout.calculate_log_probs=false",
                                               "algorithm.rollout_correction.rollout_is=null",
                                               "algorithm.rollout_correction.rollout_rs=null"])
    # the engine's log-probs: one more fp32 (max_num_seqs, vocab) tensor in the sampler
    extra = plan_phases.vllm_engine(setup, hw).activations - plan_phases.vllm_engine(without, hw).activations
    assert extra == pytest.approx(setup.cfg.actor_rollout_ref.rollout.max_num_seqs * 152064 * 4)
    assert "old log-probs" in phases
    _, _, bypass = preset_phases(model_14b, ["algorithm.rollout_correction.bypass_mode=true"])
    assert "old log-probs" not in bypass and list(bypass) == [name for name in phases if name != "old log-probs"]


def test_split_placement_plans_the_rollouts_gpus_and_the_export(model_14b):
    """The GPU preset with the trainer on 4 GPUs and vLLM (TP 2) on 2 of its own: the engine's pool alone on the
    rollout's GPUs, no engine beside the training phases, the export after the update, and both step times."""
    split = ["trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.n_gpus_per_node=2",
             "actor_rollout_ref.rollout.gpu_memory_utilization=0.9"]
    setup, hw, phases = preset_phases(model_14b, split)
    rollout = phases["rollout"]
    assert rollout.name == "rollout (vLLM, own GPUs)" and rollout.on_rollout_gpus
    assert rollout.memory == {"vllm": pytest.approx(0.9 * 80e9), "cuda contexts": plan_setup.CONTEXT_BYTES}
    engine = plan_phases.vllm_engine(plan_phases.rollout_side(setup), hw)
    assert engine.dialogues == 480  # the step's 480 dialogues on one engine of TP 2
    update = phases["update actor"]
    assert "vllm" not in update.memory and update.memory["weights"] == pytest.approx(4 * P_14B / 4, rel=1e-6)
    export = phases["weight export"]
    # bf16 weights to host memory on rank 0 (the trainer's), then from there into the rollout's GPUs (its own)
    assert not export.on_rollout_gpus and export.seconds == pytest.approx(2 * P_14B / (hw.host_gbps * 1e9))
    install = phases["weight install"]
    assert install.on_rollout_gpus and install.seconds == export.seconds and install.memory == rollout.memory
    assert "weight sync" not in phases
    training = sum(p.seconds for p in phases.values() if not p.on_rollout_gpus) / 60
    text = plan.step_time_text(list(phases.values()))
    assert f"about {rollout.seconds / 60 + training:.1f} min per step synchronously" in text
    assert f"about {max(rollout.seconds / 60, training):.1f} with the two overlapped" in text
