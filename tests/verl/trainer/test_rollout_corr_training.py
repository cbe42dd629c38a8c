"""Rollout correction in the trainer: the ``algorithm.rollout_correction`` config checks, the driver-side step
(per-turn mismatch, weights, rejection) on a synthetic dialogue batch, and real training steps on the built-in
task with the HF rollout's log-probs (decoupled mode with correction; bypass mode without the old-log-prob pass)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from verl.protocol import DataProto
from verl.trainer.config_schema import ConfigError, RolloutCorrectionConfig, compose_config
from verl.trainer.config_validation import load_config
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch
from verl.trainer.ppo.trainer_rollout_corr import actor_policy_loss, check_rollout_log_probs, correct_batch
from verl.utils.agent_turns import AGENT_TURN_IDS, agent_turn_ids_from_mask
from verl.workers.rollout.logprob_mismatch import logprob_mismatch_by_turn

KEY = "algorithm.rollout_correction"


@pytest.fixture()
def paths(paths: list[str]) -> list[str]:
    return [*paths, "actor_rollout_ref.rollout.calculate_log_probs=true"]


def test_default_is_off_and_valid_settings_load(paths):
    assert not load_config(compose_config(paths)).algorithm.rollout_correction.enabled
    cfg = load_config(compose_config(paths + [
        f"{KEY}.rollout_is=turn", f"{KEY}.rollout_is_threshold=0.5_5.0", f"{KEY}.rollout_is_batch_normalize=true",
        f"{KEY}.rollout_rs='token_k1,turn_mean_k3'", f"{KEY}.rollout_rs_threshold='0.5_2.0,0.01'"]))
    corr = cfg.algorithm.rollout_correction
    assert corr.enabled and corr.rollout_is == "turn" and corr.rollout_is_threshold == "0.5_5.0"
    assert load_config(compose_config(paths + [f"{KEY}.bypass_mode=true", f"{KEY}.loss_type=reinforce",
                                                f"{KEY}.rollout_is_threshold=3"])).algorithm.rollout_correction.bypass_mode


@pytest.mark.parametrize("overrides,message", [
    ([f"{KEY}.rollout_is_threshold=nan"], r"rollout_is_threshold=nan: .*finite and positive"),
    ([f"{KEY}.rollout_is_threshold=inf"], "finite and positive"),
    ([f"{KEY}.rollout_is_threshold=-2"], "finite and positive"),
    ([f"{KEY}.rollout_is_threshold=5.0_0.5"], "above upper bound"),
    ([f"{KEY}.rollout_is_threshold=true"], "rollout_is_threshold must be"),
    ([f"{KEY}.rollout_is=chunk"], r"rollout_is must be one of \['token', 'turn', 'sequence'\]"),
    ([f"{KEY}.rollout_rs=seq_max_k1", f"{KEY}.rollout_rs_threshold=2.0"], "not one of"),
    ([f"{KEY}.rollout_rs=token_k2"], "rollout_rs_threshold must be set"),
    ([f"{KEY}.rollout_rs=token_k2", f"{KEY}.rollout_rs_threshold=nan"], "finite and positive"),
    ([f"{KEY}.rollout_rs='token_k1,token_k2'", f"{KEY}.rollout_rs_threshold='2,0.1,3'"], "3 entries"),
    ([f"{KEY}.loss_type=reinforce"], "loss_type=reinforce is the loss of bypass mode"),
    ([f"{KEY}.loss_type=pg"], r"loss_type must be one of"),
])
def test_bad_settings_name_the_key(paths, overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(compose_config(paths + overrides))
    assert KEY in str(info.value)


def test_correction_without_rollout_log_probs_is_a_config_error(paths):
    no_log_probs = [p for p in paths if "calculate_log_probs" not in p]
    with pytest.raises(ConfigError, match="set actor_rollout_ref.rollout.calculate_log_probs=true"):
        load_config(compose_config(no_log_probs + [f"{KEY}.bypass_mode=true"]))
    load_config(compose_config(no_log_probs + [f"{KEY}.rollout_is_threshold=3.0"]))  # metrics-only settings: fine


def test_a_batch_without_rollout_log_probs_is_a_clear_error():
    batch = DataProto.from_dict(tensors={"response_mask": torch.ones(2, 3), "old_log_probs": torch.zeros(2, 3)})
    check_rollout_log_probs(batch, RolloutCorrectionConfig())  # off: nothing needed
    with pytest.raises(ValueError, match="returned no rollout_log_probs.*calculate_log_probs=true"):
        check_rollout_log_probs(batch, RolloutCorrectionConfig(rollout_rs="token_k3", rollout_rs_threshold=0.1))
    assert actor_policy_loss(RolloutCorrectionConfig()) is None
    assert actor_policy_loss(RolloutCorrectionConfig(bypass_mode=True))["loss_mode"] == "bypass_mode"


def _dialogue_batch(seed: int = 0, turns: int = 10, turn_len: int = 5, gap: int = 3, rows: int = 4,
                    scale: float = 0.02):
    """Rows of ``turns`` agent turns with user turns between them; the mismatch grows with the turn index."""
    length = turns * (turn_len + gap)
    mask = torch.zeros(rows, length)
    for k in range(turns):
        mask[:, k * (turn_len + gap): k * (turn_len + gap) + turn_len] = 1
    mask[1, 3 * (turn_len + gap):] = 0  # a shorter dialogue
    ids = agent_turn_ids_from_mask(mask)
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, length, generator=gen)
    noise = torch.randn(rows, length, generator=gen) * scale * (1 + ids.clamp(min=0))
    return old, (old + noise) * mask, mask, ids


def test_mismatch_by_turn_matches_a_loop_and_grows_with_the_turn():
    old, rollout, mask, ids = _dialogue_batch()
    metrics = logprob_mismatch_by_turn(rollout, old, ids, max_turns=8)
    for k in range(9):
        tokens = [(i, t) for i in range(mask.size(0)) for t in range(mask.size(1))
                  if (ids[i, t] == k if k < 8 else ids[i, t] >= 8)]
        diffs = [float(old[i, t]) - float(rollout[i, t]) for i, t in tokens]
        name = f"turn_{k}" if k < 8 else "turn_8plus"
        k3 = sum(math.exp(d) - 1 - d for d in diffs) / len(diffs)
        assert metrics[f"rollout/kl_k3_{name}"] == pytest.approx(k3, rel=1e-6)
        assert metrics[f"rollout/logprob_abs_diff_mean_{name}"] == pytest.approx(
            sum(abs(d) for d in diffs) / len(diffs), rel=1e-6)
    assert metrics["rollout/kl_k3_turn_7"] > 10 * metrics["rollout/kl_k3_turn_0"]
    single = agent_turn_ids_from_mask(torch.ones(2, 4))
    assert logprob_mismatch_by_turn(torch.zeros(2, 4), torch.ones(2, 4), single) == {}


def test_correct_batch_adds_weights_and_returns_the_rejection_for_after_the_advantages():
    old, rollout, mask, ids = _dialogue_batch(1, scale=0.005)
    rollout[0, ids[0] == 4] -= 0.5  # a stale turn
    batch = DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask})
    config = RolloutCorrectionConfig(rollout_is="turn", rollout_is_threshold=2.0, rollout_rs="turn_sum_k1",
                                     rollout_rs_threshold="0.5_2.0")
    metrics, kept = correct_batch(batch, config)
    assert torch.equal(batch.batch["response_mask"], mask), "the mask changes only after the advantages"
    dropped = mask - kept
    assert torch.equal(dropped.nonzero()[:, 0].unique(), torch.tensor([0]))
    assert torch.equal(dropped[0].nonzero().flatten(), (ids[0] == 4).nonzero().flatten())
    assert batch.batch["rollout_is_weights"][0, ids[0] == 4].eq(2.0).all()
    assert metrics["rollout/kl_k3_turn_4"] > metrics["rollout/kl_k3_turn_3"]  # measured before the rejection
    assert metrics["rollout_corr/rollout_rs_turn_sum_k1_turn_masked_fraction"] == pytest.approx(1 / 33)  # 3 rows of 10 turns, one of 3
    assert {"rollout_corr/k3_kl", "rollout_corr/rollout_is_mean", "rollout_corr/chi2_seq"} <= set(metrics)
    assert correct_batch(batch, RolloutCorrectionConfig(rollout_is="token"))[1] is None  # weights only: none rejected
    empty = DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout,
                                         "response_mask": torch.zeros_like(mask)})
    assert correct_batch(empty, config) == ({}, None)


def test_verl_entry_point_applies_the_rejection_at_once_keeping_the_turn_numbers():
    old, rollout, mask, ids = _dialogue_batch(1, scale=0.005)
    rollout[0, ids[0] == 4] -= 0.5
    batch = DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask})
    config = RolloutCorrectionConfig(rollout_rs="turn_sum_k1", rollout_rs_threshold="0.5_2.0")
    _, metrics = compute_rollout_correction_and_add_to_batch(batch, config)
    stale = torch.zeros_like(mask, dtype=torch.bool)
    stale[0] = ids[0] == 4
    assert torch.equal(batch.batch["response_mask"], torch.where(stale, 0.0, mask))
    assert torch.equal(batch.batch[AGENT_TURN_IDS], torch.where(stale, -1, ids))
    assert "rollout_is_weights" not in batch.batch.keys() and metrics["rollout_corr/rollout_rs_masked_fraction"] > 0


# ----------------------------------------------------------------------------------------- slow: training
def _trainer_overrides(model: str, data_dir: Path, out: Path, extra: list[str]) -> list[str]:
    return [f"actor_rollout_ref.model.path={model}", f"data.train_files={data_dir / 'train.parquet'}",
            "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "data.max_response_length=6",
            "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.optim.lr=1e-2",
            "trainer.total_training_steps=2", "trainer.n_gpus_per_node=1", "trainer.device=cpu",
            "trainer.logger=[jsonl]", f"trainer.default_local_dir={out / 'ckpt'}", f"trainer.log_dir={out / 'logs'}",
            "trainer.val_before_train=false", "trainer.resume_mode=disable",
            "actor_rollout_ref.rollout.calculate_log_probs=true", *extra]


def _train(model: str, data_dir: Path, out: Path, extra: list[str]):
    from verl.single_controller.ray import RayResourcePool
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, Role
    from verl.utils.dataset import load_tokenizer
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    pool = RayResourcePool([1], use_gpu=False, max_colocate_count=1)
    trainer = RayPPOTrainer(compose_config(_trainer_overrides(model, data_dir, out, extra)), load_tokenizer(model),
                            {Role.ActorRollout: ActorRolloutRefWorker}, pool)
    try:
        trainer.init_workers()
        return trainer.fit(), trainer.last_batch
    finally:
        trainer.shutdown()
        pool.remove()


@pytest.mark.slow
def test_training_with_correction_and_in_bypass_mode(tiny_model_path, tmp_path, ray_cluster):
    from verl.tasks.repeat_letter import make_dataset

    make_dataset(tmp_path / "data", train_size=16, val_size=4, seed=0)
    decoupled, batch = _train(tiny_model_path, tmp_path / "data", tmp_path / "decoupled", [
        f"{KEY}.rollout_is=token", f"{KEY}.rollout_is_threshold=2.0", f"{KEY}.rollout_rs=token_k3",
        f"{KEY}.rollout_rs_threshold=1.0"])
    # HF generate and the actor's forward run the same fp32 weights: the mismatch is rounding only
    assert "timing_s/old_log_prob" in decoupled
    assert 0 <= decoupled["rollout_corr/k3_kl"] < 1e-6 and decoupled["rollout/logprob_abs_diff_max"] < 1e-3
    assert decoupled["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    weights = batch.batch["rollout_is_weights"]
    mask = batch.batch["response_mask"].bool()
    assert weights.shape == mask.shape and (weights[~mask] == 0).all()
    assert (weights[mask] - 1).abs().max() < 1e-3

    bypass, batch = _train(tiny_model_path, tmp_path / "data", tmp_path / "bypass", [
        f"{KEY}.bypass_mode=true", f"{KEY}.rollout_rs=token_k3", f"{KEY}.rollout_rs_threshold=1.0"])
    assert "timing_s/old_log_prob" not in bypass, "bypass mode must skip the old-log-prob pass"
    assert "rollout_log_probs" not in batch.batch.keys() and "old_log_probs" in batch.batch.keys()
    # computed by the actor's bypass loss against its current policy, per micro-batch of the one mini-batch (before
    # its update: the policy that sampled)
    assert 0 <= bypass["rollout_corr/k3_kl"] < 1e-6 and "rollout_corr/rollout_rs_masked_fraction" in bypass
    assert "rollout/logprob_abs_diff_max" not in bypass  # no recomputed old log-probs to compare with
