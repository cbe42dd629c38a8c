"""Rollout correction (veRL 0.9.x names and semantics, plus turn-level units) against an independent float64
reference on random dialogue-shaped inputs: several agent turns per row with user turns (mask 0) between them,
NaN at the masked positions, a row without any loss token."""
import math

import pytest
import torch
from tests.helpers.rollout_corr_reference import assert_metrics_match, dialogue_batch, offpolicy, rejection, units_of_row, weights

from verl.errors import ContractError
from verl.protocol import DataProto
from verl.trainer.ppo import rollout_corr_helper as helper
from verl.trainer.ppo.rollout_corr_options import (
    SUPPORTED_ROLLOUT_RS_OPTIONS,
    parse_rollout_is_threshold,
    parse_rollout_rs_thresholds,
    rejection_options,
)
from verl.utils.agent_turns import AGENT_TURN_IDS, agent_turn_ids, agent_turn_ids_from_mask


IS_CASES = [("token", 2.0, False), ("token", "0.5_1.5", False), ("token", 1.2, True), ("turn", 2.0, False),
            ("turn", "0.6_1.8", True), ("turn", 1.1, True), ("sequence", 3.0, False), ("sequence", "0.3_3.0", True)]


@pytest.mark.parametrize("level,threshold,normalize", IS_CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_weights_match_float64_reference(level, threshold, normalize, seed):
    old, rollout, mask = dialogue_batch(seed)
    upper, lower = parse_rollout_is_threshold(threshold)
    got, metrics = helper.compute_rollout_correction_weights(old - rollout, mask, level, threshold, normalize)
    expected, expected_metrics = weights(old - rollout, mask, level, upper, lower, normalize)
    assert torch.allclose(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-9, atol=1e-12)
    assert_metrics_match(metrics, expected_metrics)


def test_float32_weights_agree_with_reference_to_float32_precision():
    old, rollout, mask = dialogue_batch(3, dtype=torch.float32)
    got, metrics = helper.compute_rollout_correction_weights(old - rollout, mask, "turn", 2.0, True)
    expected, expected_metrics = weights((old - rollout).double(), mask, "turn", 2.0, None, True)
    assert torch.allclose(got.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-5)
    assert_metrics_match(metrics, expected_metrics, rel=1e-4)


def test_a_sequence_ratio_over_masked_positions_is_caught():
    """The check can fail: summing log-ratios over user-turn positions too (a plausible bug) gives other
    weights than the reference, while the implementation matches it."""
    old, rollout, mask = dialogue_batch(4, masked_value=0.0)
    rollout = rollout + (mask == 0) * 0.3  # user-turn positions carry a log-ratio of their own
    expected, _ = weights(old - rollout, mask, "sequence", 1e6)
    expected = torch.tensor(expected, dtype=torch.float64)
    got, _ = helper.compute_rollout_correction_weights(old - rollout, mask, "sequence", 1e6)
    wrong = (old - rollout).sum(dim=-1, keepdim=True).exp() * mask
    assert torch.allclose(got, expected, rtol=1e-9)
    assert not torch.allclose(wrong, expected, rtol=1e-3)


OPTION_SETS = [
    [("token_k1", "0.8_1.25")], [("token_k2", "0.01")], [("token_k3", "0.005")],
    [("seq_sum_k1", "0.5_2.0")], [("seq_sum_k2", "0.1")], [("seq_sum_k3", "0.1")], [("seq_mean_k1", "1.1")],
    [("seq_mean_k2", "0.02")], [("seq_mean_k3", "0.02")], [("seq_max_k2", "0.05")], [("seq_max_k3", "0.05")],
    [("turn_sum_k1", "0.7_1.4")], [("turn_sum_k2", "0.05")], [("turn_sum_k3", "0.05")], [("turn_mean_k1", "1.1")],
    [("turn_mean_k2", "0.02")], [("turn_mean_k3", "0.02")], [("turn_max_k2", "0.05")], [("turn_max_k3", "0.05")],
    [("token_k1", "0.7_1.4"), ("turn_mean_k3", "0.03"), ("seq_max_k2", "0.2")],
]


def test_every_supported_option_is_covered():
    assert {name for options in OPTION_SETS for name, _ in options} == SUPPORTED_ROLLOUT_RS_OPTIONS


@pytest.mark.parametrize("options", OPTION_SETS, ids=lambda o: "+".join(n for n, _ in o))
@pytest.mark.parametrize("seed", [0, 1])
def test_rejection_matches_float64_reference(options, seed):
    old, rollout, mask = dialogue_batch(seed)
    names, specs = ",".join(n for n, _ in options), ",".join(s for _, s in options)
    got, metrics = helper.compute_rollout_rejection_mask(old - rollout, mask, names, specs)
    expected, expected_metrics = rejection(old - rollout, mask, options)
    assert torch.equal(got, torch.tensor(expected, dtype=mask.dtype))
    assert got.dtype == mask.dtype
    assert_metrics_match(metrics, expected_metrics)


def test_offpolicy_metrics_match_float64_reference():
    old, rollout, mask = dialogue_batch(5, scale=0.5)
    assert_metrics_match(helper.compute_offpolicy_metrics(old, rollout, mask), offpolicy(old, rollout, mask))
    only_training = helper.compute_offpolicy_metrics(old, None, mask)
    assert sorted(only_training) == ["training_log_ppl", "training_ppl"]


def test_combined_call_returns_weights_mask_and_prefixed_metrics():
    old, rollout, mask = dialogue_batch(6)
    proto, new_mask, metrics = helper.compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_is="turn", rollout_is_threshold=2.0, rollout_rs="turn_mean_k3",
        rollout_rs_threshold=0.01)
    assert isinstance(proto, DataProto) and list(proto.batch.keys()) == ["rollout_is_weights"]
    exp_w, exp_is = weights(old - rollout, mask, "turn", 2.0)
    exp_mask, exp_rs = rejection(old - rollout, mask, [("turn_mean_k3", "0.01")])
    assert torch.allclose(proto.batch["rollout_is_weights"], torch.tensor(exp_w, dtype=torch.float64))
    assert torch.equal(new_mask, torch.tensor(exp_mask))
    expected = {f"rollout_corr/{k}": v for k, v in {**exp_is, **exp_rs, **offpolicy(old, rollout, mask)}.items()}
    assert_metrics_match(metrics, expected)
    proto, same_mask, metrics = helper.compute_rollout_correction_and_rejection_mask(old, rollout, mask)
    assert proto is None and torch.equal(same_mask, mask) and same_mask is not mask
    assert "rollout_corr/k3_kl" in metrics and not any("rollout_is" in k or "rollout_rs" in k for k in metrics)


def test_loop_turn_ids_define_the_turns():
    """A rollout loop may number turns itself (here it joins a row's first two runs into one turn)."""
    old, rollout, mask = dialogue_batch(7, masked_value=0.0)
    ids = agent_turn_ids_from_mask(mask)
    joined = torch.where(ids >= 1, ids - 1, ids)  # runs 0 and 1 form turn 0
    expected, expected_metrics = weights(old - rollout, mask, "turn", 1.5, turn_ids=joined)
    got, metrics = helper.compute_rollout_correction_weights(old - rollout, mask, "turn", 1.5, turn_ids=joined)
    assert torch.allclose(got, torch.tensor(expected, dtype=torch.float64))
    assert_metrics_match(metrics, expected_metrics)
    by_runs, _ = helper.compute_rollout_correction_weights(old - rollout, mask, "turn", 1.5)
    assert not torch.allclose(got, by_runs)
    _, rs_metrics = helper.compute_rollout_rejection_mask(old - rollout, mask, "turn_sum_k2", 0.02, turn_ids=joined)
    assert_metrics_match(rs_metrics, rejection(old - rollout, mask, [("turn_sum_k2", "0.02")], turn_ids=joined)[1])
    stale = torch.where(mask != 0, joined, torch.full_like(joined, 7))  # ids outside the mask are ignored
    assert torch.equal(helper.compute_rollout_correction_weights(old - rollout, mask, "turn", 1.5, turn_ids=stale)[0],
                       got)
    with pytest.raises(ValueError, match="every loss token is in a turn"):
        helper.compute_rollout_correction_weights(old - rollout, mask, "turn", 1.5, turn_ids=joined - 1)


def test_one_bad_turn_of_a_long_dialogue_is_dropped_alone():
    """15 agent turns of 8 tokens with user turns between them; turn 6 was sampled by a stale policy. A turn
    option drops exactly that turn; a sequence option drops the whole dialogue; token-level weights barely move
    the dialogue's mean weight while the turn weight of turn 6 is truncated."""
    turns, turn_len, gap = 15, 8, 3
    length = turns * (turn_len + gap)
    mask = torch.zeros(2, length)
    for k in range(turns):
        mask[:, k * (turn_len + gap): k * (turn_len + gap) + turn_len] = 1
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(2, length, generator=gen, dtype=torch.float64)
    rollout = old + torch.randn(2, length, generator=gen, dtype=torch.float64) * 0.01
    bad = slice(6 * (turn_len + gap), 6 * (turn_len + gap) + turn_len)
    rollout[0, bad] = old[0, bad] - 0.4  # pi_train / pi_rollout = e^0.4 per token of turn 6
    kept, metrics = helper.compute_rollout_rejection_mask(old - rollout, mask, "turn_sum_k1", "0.5_2.0")
    dropped = (mask - kept).nonzero().tolist()
    assert {tuple(p) for p in dropped} == {(0, t) for t in range(bad.start, bad.stop)}
    assert metrics["rollout_rs_turn_sum_k1_turn_masked_fraction"] == pytest.approx(1 / 30)
    seq_kept, _ = helper.compute_rollout_rejection_mask(old - rollout, mask, "seq_sum_k1", "0.5_2.0")
    assert seq_kept[0].sum() == 0 and torch.equal(seq_kept[1], mask[1])
    turn_w, _ = helper.compute_rollout_correction_weights(old - rollout, mask, "turn", 2.0)
    assert torch.allclose(turn_w[0, bad], torch.full((turn_len,), 2.0, dtype=torch.float64))  # e^3.2 truncated
    token_w, _ = helper.compute_rollout_correction_weights(old - rollout, mask, "token", 2.0)
    assert float(token_w[0, bad].min()) == pytest.approx(math.exp(0.4), rel=0.05)


def test_units_match_the_reference_segmentation():
    _, _, mask = dialogue_batch(8)
    from verl.trainer.ppo.rollout_corr_units import Units

    for level in ("token", "turn", "sequence"):
        units = Units.for_level(level, mask)
        for i in range(mask.size(0)):
            expected = units_of_row(mask[i].tolist(), None, level)
            got = [sorted((units.ids[i] == k).nonzero().flatten().tolist()) for k in range(units.count)]
            assert [g for g in got if g] == expected
            assert units.valid[i].sum() == len(expected)


def test_batch_function_applies_mask_weights_and_keeps_turn_numbering():
    old, rollout, mask = dialogue_batch(9, masked_value=0.0)
    ids = agent_turn_ids_from_mask(mask)
    batch = DataProto.from_dict(tensors={"old_log_probs": old.float(), "rollout_log_probs": rollout.float(),
                                         "response_mask": mask})
    config = {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "token_k2",
              "rollout_rs_threshold": 0.005}
    batch, metrics = helper.compute_rollout_correction_and_add_to_batch(batch, config)
    expected_mask, _ = rejection((old - rollout).float(), mask, [("token_k2", "0.005")])
    assert torch.equal(batch.batch["response_mask"], torch.tensor(expected_mask))
    assert 0 < metrics["rollout_corr/rollout_rs_masked_fraction"] < 1
    assert batch.batch["rollout_is_weights"].shape == mask.shape
    new_ids = agent_turn_ids(batch.batch)  # consistent with the new mask, numbered as before the rejection
    assert torch.equal(new_ids, torch.where(batch.batch["response_mask"] != 0, ids, torch.full_like(ids, -1)))
    assert AGENT_TURN_IDS in batch.batch.keys()


def test_bypass_mode_moves_rollout_log_probs_to_old_log_probs():
    rollout = torch.randn(2, 3)
    batch = DataProto.from_dict(tensors={"rollout_log_probs": rollout, "response_mask": torch.ones(2, 3)})
    policy_loss = {}
    helper.apply_bypass_mode(batch, {"bypass_mode": True}, policy_loss)
    assert torch.equal(batch.batch["old_log_probs"], rollout) and "rollout_log_probs" not in batch.batch.keys()
    assert policy_loss == {"loss_mode": "bypass_mode", "rollout_correction": {"bypass_mode": True}}
    with pytest.raises(ValueError, match="calculate_log_probs=true"):
        helper.apply_bypass_mode(DataProto.from_dict(tensors={"response_mask": torch.ones(2, 3)}))


def test_inputs_without_a_loss_token_or_rows():
    mask = torch.zeros(2, 4)
    with pytest.raises(ContractError, match="at least one valid token"):
        helper.compute_rollout_correction_and_rejection_mask(torch.zeros(2, 4), torch.zeros(2, 4), mask)
    with pytest.raises(AssertionError):  # veRL asserts here; ContractError is both
        helper.compute_offpolicy_metrics(torch.zeros(2, 4), torch.zeros(2, 4), mask)
    empty = torch.zeros(0, 4)
    got, metrics = helper.compute_rollout_rejection_mask(empty, empty, "token_k1", 2.0)
    assert got.shape == (0, 4) and metrics == {}
    with pytest.raises(ContractError, match="one shape"):
        helper.compute_rollout_correction_and_rejection_mask(torch.zeros(2, 4), torch.zeros(2, 3), torch.ones(2, 4))


@pytest.mark.parametrize("spec,message", [
    ("nan", "finite and positive"), ("inf", "finite and positive"), (float("nan"), "finite and positive"),
    (0, "finite and positive"), (-1.0, "finite and positive"), ("2_1", "above upper"), ("a", "not a number"),
    ("0.5_1_2", "one number or 'lower_upper'"), ("", "must not be empty"), ("1e400", "finite"),
])
def test_bad_is_thresholds_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_rollout_is_threshold(spec)


def test_threshold_specs_parse_like_verl():
    assert parse_rollout_is_threshold(2) == (2.0, None)
    assert parse_rollout_is_threshold(" 0.5_5 ") == (5.0, 0.5)
    with pytest.raises(TypeError):
        parse_rollout_is_threshold(True)
    assert parse_rollout_rs_thresholds(["token_k1", "seq_max_k3"], "2.0,0.1") == {
        "token_k1": {"lower": 0.5, "upper": 2.0}, "seq_max_k3": {"lower": None, "upper": 0.1}}
    assert parse_rollout_rs_thresholds(["token_k3", "turn_sum_k2"], 0.5)["turn_sum_k2"]["upper"] == 0.5
    options = rejection_options("token_k1, token_k1 ,seq_mean_k3", "0.8_1.25,0.01")
    assert [(o.name, o.level, o.aggregate, o.estimator) for o in options] == [
        ("token_k1", "token", None, "k1"), ("seq_mean_k3", "sequence", "mean", "k3")]
    assert options[0].low == pytest.approx(math.log(0.8)) and options[0].high == pytest.approx(math.log(1.25))
    for bad, message in [(("token_k4", 1.0), "not one of"), (("seq_max_k1", 2.0), "not one of"),
                         (("token_k2", "0.1_0.2"), "one upper bound"), (("token_k1,token_k2", "1,2,3"), "3 entries"),
                         (("token_k1", "0.5"), ">= 1"), (("token_k1", None), "must be set"), ((" , ", 1.0), "at least one")]:
        with pytest.raises(ValueError, match=message):
            rejection_options(*bad)
