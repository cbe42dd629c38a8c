"""The 14B model and the GPU preset's keys that the plan tests build their per-phase tables from."""
from __future__ import annotations

import json
from pathlib import Path

from verl.trainer.config_schema import compose_config
from verl.trainer.config_validation import build_config
from verl.trainer.plan_phases import build_phases
from verl.trainer.plan_setup import Hardware, make_setup
from verl.trainer.presets import preset_args
from verl.utils.memory_model import ModelShape

QWEN25_14B = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 5120, "intermediate_size": 13824,
              "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8,
              "tie_word_embeddings": False}
P_14B = 14_770_033_664
# the GPU preset's keys (verl/trainer/config/preset/gpu.yaml) that shape the plan, with its values, and the base
# config's prompt length
PRESET_GPU = ["data.max_prompt_length=2048", *preset_args("gpu", (
    "data.train_batch_size", "actor_rollout_ref.rollout.n", "trainer.n_gpus_per_node", "data.max_response_length",
    "actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.actor.use_kl_loss",
    "actor_rollout_ref.actor.entropy_coeff", "actor_rollout_ref.model.enable_gradient_checkpointing",
    "actor_rollout_ref.model.use_remove_padding", "actor_rollout_ref.actor.use_dynamic_bsz",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", "actor_rollout_ref.ref.fsdp_config.param_offload",
    "actor_rollout_ref.rollout.name", "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "actor_rollout_ref.rollout.gpu_memory_utilization", "actor_rollout_ref.rollout.enforce_eager",
    "rollout_loop.config.max_turns", "rollout_loop.config.max_tokens_per_turn",
    "actor_rollout_ref.rollout.calculate_log_probs", "algorithm.rollout_correction.rollout_is",
    "algorithm.rollout_correction.rollout_rs", "algorithm.rollout_correction.rollout_rs_threshold"))]


def write_model_14b(model_dir: Path) -> str:
    """Write Qwen2.5-14B's config.json into `model_dir` and return the directory as a string."""
    (model_dir / "config.json").write_text(json.dumps(QWEN25_14B))
    return str(model_dir)


def preset_phases(model_dir, extra=()):
    """(setup, hardware, phases by name) of the plan for the GPU preset plus the `extra` overrides."""
    cfg = build_config(compose_config([f"actor_rollout_ref.model.path={model_dir}", *PRESET_GPU, *extra],
                                      "sead_trainer"))
    setup = make_setup(cfg, ModelShape.from_model_dir(model_dir), None)
    hw = Hardware()
    return setup, hw, {p.name.split(" (")[0]: p for p in build_phases(setup, hw)}
