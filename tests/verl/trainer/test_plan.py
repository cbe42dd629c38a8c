"""``python -m verl.trainer.plan``: the per-phase table from the real config, hand-computed states, advice."""

from __future__ import annotations

import json

import pytest

from verl.trainer import plan as plan_mod
from verl.trainer.config_schema import compose_config
from verl.trainer.config_validation import build_config
from verl.utils.memory_model import ModelShape

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
    setup = plan_mod.make_setup(cfg, ModelShape.from_hf_config(QWEN25_7B), critic)
    hw = plan_mod.Hardware()
    phases = plan_mod.build_phases(setup, hw)
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
    assert phases["rollout"].memory["cuda contexts"] == 2 * plan_mod.CONTEXT_BYTES


def test_advice_turns_on_checkpointing_and_shrinks_micro_batches(model_7b):
    setup, hw, phases = _phases(model_7b, ["actor_rollout_ref.rollout.micro_batch_size_per_gpu=64"])
    assert phases["update actor"].total > hw.memory_bytes
    advice = plan_mod.advise(setup, hw, list(phases.values()))
    assert any("enable_gradient_checkpointing=true" in a for a in advice)
    rollout_advice = [a for a in advice if "rollout.micro_batch_size_per_gpu=" in a]
    assert len(rollout_advice) == 1
    fit = int(rollout_advice[0].split("micro_batch_size_per_gpu=")[1].split()[0])
    assert plan_mod.rollout_phase(setup, hw, fit).total <= hw.memory_bytes < plan_mod.rollout_phase(
        setup, hw, fit + 1).total


def test_cli_prints_every_phase_and_verdict(model_7b, capsys):
    plan_mod.main(["--config-name", "sead_trainer", "--gpu-memory-gb", "80",
                   f"actor_rollout_ref.model.path={model_7b}", *SEAD_GPU])
    out = capsys.readouterr().out
    assert "7.62B parameters" in out and "update actor" in out and "DOES NOT FIT" in out
    plan_mod.main(["--config-name", "sead_trainer", f"actor_rollout_ref.model.path={model_7b}", *SEAD_GPU,
                   "actor_rollout_ref.model.enable_gradient_checkpointing=true"])
    assert "fits in 80 GB" in capsys.readouterr().out


def test_cli_errors_name_the_problem(tmp_path):
    with pytest.raises(SystemExit, match="model.path is required"):
        plan_mod.main([])
    with pytest.raises(SystemExit, match="config.json"):
        plan_mod.main([f"actor_rollout_ref.model.path={tmp_path}"])
    with pytest.raises(SystemExit, match="not_a_key"):
        plan_mod.main(["actor_rollout_ref.not_a_key=1"])


def test_fsdp1_generation_gathers_one_unit_at_a_time(model_7b):
    _, _, fsdp2 = _phases(model_7b, [])
    _, _, fsdp1 = _phases(model_7b, ["actor_rollout_ref.actor.strategy=fsdp"])
    assert fsdp2["rollout"].memory["gathered units"] == 2 * P_7B
    assert fsdp1["rollout"].memory["gathered units"] == fsdp1["old log-probs"].memory["gathered units"] < P_7B
