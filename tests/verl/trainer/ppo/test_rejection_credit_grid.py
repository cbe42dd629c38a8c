"""Rollout rejection meets credit assignment: every advantage estimator x every rejection option x diagnosis
reweighting on/off x padded/packed actor forwards, on dialogue rows with user turns between agent turns (and a
turn-id gap), against an independent float64 reference of the rule (tests/helpers/credit_reference.py): credit is
assigned to the dialogue as sampled, then the rejected tokens leave the loss.

Per cell, the trainer's advantage step (``advantage_step``: decoupled correction, estimator, reweighting) is
checked token by token (mask, turn ids, advantages, the returns of the kept tokens, IS weights, rewards and
per-turn signals left as sampled), and the actor's loss on its output (one mini-batch per cell, learning rate 0
so every cell sees the same policy) against the reference loss: the kept tokens' -A * w over their count, the
old log-probs being the policy's own (a float64 HF forward), so the ratio is 1 up to rounding.
"""
from __future__ import annotations

import copy

import pytest
import torch
from tests.helpers import credit_reference as ref
from tests.helpers.rejection_grid_batch import (
    GAP_ROW,
    LABEL_WEIGHTS,
    LAST_TOKEN_ROW,
    ROWS,
    STALE_ROW,
    STALE_ROW_LAST_TURN,
    reference_log_probs,
    sampled_batch,
    with_log_probs,
)
from tests.helpers.rollout_corr_reference import rejection, weights

from verl.protocol import DataProto
from verl.trainer.config_schema import (
    AlgorithmConfig,
    DiagnosisReweightConfig,
    RolloutCorrectionConfig,
    TurnMixedConfig,
)
from verl.trainer.ppo.rollout_corr_options import SUPPORTED_ROLLOUT_RS_OPTIONS
from verl.trainer.ppo.trainer_advantage import advantage_step

ESTIMATORS = ("gae", "grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "reinforce_plus_plus",
              "reinforce_plus_plus_baseline", "remax", "turn_mixed", "turn_gae", "turn_gae_without_scores")
THRESHOLDS = {  # each rejects some tokens of the grid's batch and keeps some rows (checked per cell)
    "token_k1": "0.5_2.0", "token_k2": "0.1", "token_k3": "0.1",
    "seq_sum_k1": "0.5_2.0", "seq_mean_k1": "0.8_1.25", "seq_sum_k2": "0.1", "seq_sum_k3": "0.1",
    "seq_mean_k2": "0.02", "seq_mean_k3": "0.02", "seq_max_k2": "0.1", "seq_max_k3": "0.1",
    "turn_sum_k1": "0.5_2.0", "turn_mean_k1": "0.8_1.25", "turn_sum_k2": "0.1", "turn_sum_k3": "0.1",
    "turn_mean_k2": "0.02", "turn_mean_k3": "0.02", "turn_max_k2": "0.1", "turn_max_k3": "0.1",
}
OPTIONS = sorted(SUPPORTED_ROLLOUT_RS_OPTIONS)
IS_LEVELS = (None, "token", "turn", "sequence")  # the IS weights of a cell cycle with its option
APPLY_TO = ("all", "negative", "positive")  # so does the reweighting's sign filter
GAMMA, LAM, TURN_WEIGHT = 0.9, 0.8, 0.5
CELLS = [(e, o, d) for e in ESTIMATORS for o in OPTIONS for d in (False, True)]


def test_the_grid_covers_every_rejection_option():
    assert set(THRESHOLDS) == SUPPORTED_ROLLOUT_RS_OPTIONS


def _settings(estimator: str, option: str, diagnosis: bool) -> dict:
    index = OPTIONS.index(option)
    return {"estimator": estimator.removesuffix("_without_scores"), "scores": not estimator.endswith("_scores"),
            "is_level": IS_LEVELS[index % len(IS_LEVELS)], "apply_to": APPLY_TO[index % len(APPLY_TO)],
            "by_std": index % 2 == 0, "option": option, "diagnosis": diagnosis}


def _algorithm(s: dict) -> AlgorithmConfig:
    correction = RolloutCorrectionConfig(rollout_is=s["is_level"], rollout_is_threshold=2.0,
                                         rollout_rs=s["option"], rollout_rs_threshold=THRESHOLDS[s["option"]])
    return AlgorithmConfig(adv_estimator=s["estimator"], gamma=GAMMA, lam=LAM, norm_adv_by_std_in_grpo=s["by_std"],
                           turn_mixed=TurnMixedConfig(turn_weight=TURN_WEIGHT), rollout_correction=correction,
                           diagnosis_reweight=DiagnosisReweightConfig(enable=s["diagnosis"], weights=LABEL_WEIGHTS,
                                                                      apply_to=s["apply_to"]))


@pytest.fixture(scope="module")
def sampled(tiny_model_path) -> DataProto:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float64)
    batch = sampled_batch(model.config.vocab_size)
    return with_log_probs(batch, reference_log_probs(model, batch))


def _expected(sampled: DataProto, estimator: str, option: str, diagnosis: bool) -> dict:
    """The float64 reference of one cell (see the module docstring)."""
    s = _settings(estimator, option, diagnosis)
    b = sampled.batch
    labels, uid = list(sampled.non_tensor_batch["turn_labels"]), list(sampled.non_tensor_batch["uid"])
    mask, ids = b["response_mask"], b["agent_turn_ids"]
    log_ratio = b["old_log_probs"] - b["rollout_log_probs"]
    kept, _ = rejection(log_ratio, mask, [(option, THRESHOLDS[option])], turn_ids=ids)
    is_w = None if s["is_level"] is None else weights(log_ratio, mask, s["is_level"], 2.0, turn_ids=ids)[0]
    inputs = {k: b[k] for k in b.keys() if s["scores"] or k != "turn_scores"}
    advantages, returns = ref.estimator(s["estimator"], inputs, uid, GAMMA, LAM, s["by_std"], TURN_WEIGHT)
    if diagnosis:
        advantages = ref.diagnosis(advantages, ids, labels, LABEL_WEIGHTS, s["apply_to"])
    advantages, new_mask, new_ids = ref.credit_then_reject(advantages, ids, kept)
    return {"advantages": advantages, "returns": returns, "response_mask": new_mask, "agent_turn_ids": new_ids,
            "rollout_is_weights": is_w, "loss": ref.token_mean_pg_loss(advantages, kept, is_w), "kept": kept}


@pytest.fixture(scope="module")
def expected(sampled):
    """The reference of a cell, computed once."""
    cache: dict = {}

    def of(*cell) -> dict:
        if cell not in cache:
            cache[cell] = _expected(sampled, *cell)
        return cache[cell]
    return of


def _step(sampled: DataProto, estimator: str, option: str, diagnosis: bool):
    """(the batch after the trainer's advantage step, None) or (None, the exception it raised)."""
    s = _settings(estimator, option, diagnosis)
    batch = copy.deepcopy(sampled)
    if not s["scores"]:
        batch.batch.pop("turn_scores")
    try:
        advantage_step(batch, _algorithm(s), num_repeat=3)
    except Exception as exc:  # noqa: BLE001 - reported by the cell's test
        return None, exc
    return batch, None


@pytest.fixture(scope="module")
def steps(sampled) -> dict:
    return {cell: _step(sampled, *cell) for cell in CELLS}


def _close(got: torch.Tensor, expected: list[list[float]], where: torch.Tensor, what: str) -> None:
    want = torch.tensor(expected, dtype=torch.float64)
    diff = (got.double() - want).abs()[where]
    tolerance = 1e-9 + 1e-9 * want.abs()[where]
    assert bool((diff <= tolerance).all()), f"{what}: largest difference {float(diff.max()):.3g}"


def test_the_batch_meets_each_situation_by_construction(sampled):
    b = sampled.batch
    mask, ids, scores = b["response_mask"], b["agent_turn_ids"], b["turn_scores"]
    log_ratio = b["old_log_probs"] - b["rollout_log_probs"]
    kept, _ = rejection(log_ratio, mask, [("turn_mean_k3", THRESHOLDS["turn_mean_k3"])], turn_ids=ids)
    kept = torch.tensor(kept)
    rejected = (mask != 0) & (kept == 0)
    assert bool((scores[rejected] != 0).any()), "no rejected turn carries a turn score"
    last_turn = ids[STALE_ROW_LAST_TURN] == ids[STALE_ROW_LAST_TURN].max()
    assert bool(rejected[STALE_ROW_LAST_TURN][last_turn].all()) and bool(kept[STALE_ROW_LAST_TURN].any())
    assert not bool(kept[STALE_ROW].any()) and bool(mask[STALE_ROW].any())
    token_kept, _ = rejection(log_ratio, mask, [("token_k3", THRESHOLDS["token_k3"])], turn_ids=ids)
    row = torch.tensor(token_kept[LAST_TOKEN_ROW])
    last = int(mask[LAST_TOKEN_ROW].nonzero().max())
    assert row[last] == 0 and bool((row[:last] == mask[LAST_TOKEN_ROW][:last]).all())
    assert b["token_level_rewards"][LAST_TOKEN_ROW, last] > 0.5, "the rejected last token carries the outcome"
    assert sorted(set(ids[GAP_ROW].tolist())) == [-1, 0, 2, 3]


@pytest.mark.parametrize("estimator,option,diagnosis", CELLS)
def test_advantage_step_follows_the_rule(steps, sampled, expected, estimator, option, diagnosis):
    batch, error = steps[(estimator, option, diagnosis)]
    if error is not None:
        raise error
    expected = expected(estimator, option, diagnosis)
    kept = torch.tensor(expected["kept"])
    mask = sampled.batch["response_mask"].bool()
    assert 0 < int(kept.sum()) < int(mask.sum()) and int((kept.sum(-1) > 0).sum()) >= 2, "precondition"
    b = batch.batch
    assert torch.equal(b["response_mask"].double(), torch.tensor(expected["response_mask"], dtype=torch.float64))
    assert b["agent_turn_ids"].tolist() == expected["agent_turn_ids"]
    _close(b["advantages"], expected["advantages"], mask, "advantages")
    _close(b["returns"], expected["returns"], kept.bool(), "returns")  # what the critic trains on
    if expected["rollout_is_weights"] is not None:
        _close(b["rollout_is_weights"], expected["rollout_is_weights"], mask, "rollout_is_weights")
    else:
        assert "rollout_is_weights" not in b.keys()
    for key in ("token_level_rewards", "turn_scores", "values"):
        if key in b.keys():
            assert torch.equal(b[key], sampled.batch[key]), f"{key} changed"
    assert list(batch.non_tensor_batch["turn_labels"]) == list(sampled.non_tensor_batch["turn_labels"])


# ------------------------------------------------------------------------------------- the actor on each cell
def _actor_losses(tiny_model_path: str, steps: dict, packed: bool) -> dict:
    """Per cell whose step ran: the actor's pg_loss on its batch (one mini-batch per cell, learning rate 0)."""
    from tests.helpers.ppo_batch_helpers import actor_config
    from transformers import AutoModelForCausalLM

    from verl.utils.optim import build_optimizer
    from verl.workers.actor.dp_actor import DataParallelPPOActor

    cells = [cell for cell in CELLS if steps[cell][0] is not None]
    if not cells:
        return {}
    keys = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "old_log_probs",
            "advantages", "rollout_is_weights")
    parts = []
    for cell in cells:
        b = steps[cell][0].batch
        tensors = {k: b[k] for k in keys if k in b.keys()}
        tensors.setdefault("rollout_is_weights", torch.ones_like(b["advantages"]))
        tensors["old_log_probs"] = tensors["old_log_probs"].float()
        tensors["advantages"] = tensors["advantages"].float()
        tensors["rollout_is_weights"] = tensors["rollout_is_weights"].float()
        parts.append(DataProto.from_dict(tensors=tensors))
    data = DataProto.concat(parts)
    data.meta_info["temperature"] = 1.0
    cfg = actor_config(use_kl_loss=False, entropy_coeff=0.0, ppo_mini_batch_size=ROWS,
                       ppo_micro_batch_size_per_gpu=ROWS // 2, use_remove_padding=packed, grad_clip=None,
                       optim={"lr": 0.0, "weight_decay": 0.0})
    module = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    actor = DataParallelPPOActor(cfg, module, build_optimizer(module.parameters(), cfg.optim))
    losses = actor.update_policy(data)["actor/pg_loss"]
    assert len(losses) == len(cells)
    return dict(zip(cells, losses))


@pytest.fixture(scope="module")
def actor_losses(tiny_model_path, steps) -> dict:
    return {packed: _actor_losses(tiny_model_path, steps, packed) for packed in (False, True)}


@pytest.mark.slow  # the actor's pass over every cell: ~50 s of CPU
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("estimator,option,diagnosis", CELLS)
def test_actor_loss_counts_only_kept_tokens_with_credit_from_the_sampled_dialogue(
        actor_losses, steps, expected, estimator, option, diagnosis, packed):
    cell = (estimator, option, diagnosis)
    if steps[cell][1] is not None:
        raise steps[cell][1]
    expected = expected(*cell)
    kept = expected["kept"]
    scale = sum(abs(a) for row, k in zip(expected["advantages"], kept) for a, m in zip(row, k) if m)
    scale /= max(1.0, float(sum(map(sum, kept))))
    assert actor_losses[packed][cell] == pytest.approx(expected["loss"], abs=2e-5 * (scale + 1e-3))
