"""Advantage estimators of core_algos against independent plain-Python float64 references.

Masks have interior masked spans (user turns), right padding and an all-masked row, so the skipping of
observation tokens and the handling of empty rows are exercised on every estimator.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from verl.trainer.ppo import core_algos
from verl.trainer.ppo.core_algos import (
    AdvantageEstimator,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_adv_estimator_fn,
    register_adv_est,
)

BS, T = 7, 12


def random_mask(rng: random.Random, bs: int = BS, length: int = T) -> list[list[int]]:
    """Multi-turn style masks: agent spans broken by user spans, right padding, row 1 fully masked."""
    rows = []
    for i in range(bs):
        row = [0] * length
        if i != 1:
            used = rng.randint(length // 2, length)
            row[:used] = [1] * used
            for _ in range(rng.randint(1, 2)):  # interior user turns
                start = rng.randint(1, max(1, used - 3))
                for t in range(start, min(used - 1, start + rng.randint(1, 3))):
                    row[t] = 0
        rows.append(row)
    return rows


def random_matrix(rng: random.Random, bs: int = BS, length: int = T, scale: float = 1.0) -> list[list[float]]:
    """A bs x length matrix of Gaussian floats."""
    return [[rng.gauss(0.0, scale) for _ in range(length)] for _ in range(bs)]


def outcome_rewards(rng: random.Random, mask: list[list[int]]) -> list[list[float]]:
    """Rewards on the last loss-carrying token of each row (plus a little noise elsewhere on some rows)."""
    rewards = [[0.0] * len(row) for row in mask]
    for i, row in enumerate(mask):
        agent = [t for t, m in enumerate(row) if m]
        if agent:
            rewards[i][agent[-1]] = rng.choice([0.0, 1.0, 10.0, rng.uniform(-2, 2)])
        if i % 3 == 0:
            rewards[i][rng.randrange(len(row))] += rng.uniform(-0.5, 0.5)
    return rewards


def ref_whiten(values: list[list[float]], mask: list[list[int]]) -> list[list[float]]:
    """(x - mean) / sqrt(unbiased var + 1e-8), statistics over the masked entries, applied everywhere."""
    picked = [v for vrow, mrow in zip(values, mask) for v, m in zip(vrow, mrow) if m]
    mean = sum(picked) / len(picked)
    var = sum((v - mean) ** 2 for v in picked) / (len(picked) - 1)
    return [[(v - mean) / math.sqrt(var + 1e-8) for v in row] for row in values]


def ref_groups(index: list) -> dict:
    """Group id -> row numbers."""
    groups: dict = {}
    for i, g in enumerate(index):
        groups.setdefault(g, []).append(i)
    return groups


def t64(x: list) -> torch.Tensor:
    """A float64 tensor of nested lists."""
    return torch.tensor(x, dtype=torch.float64)


def assert_matches(actual: torch.Tensor, expected: list) -> None:
    """Equal to the reference to 1e-6 in float64."""
    assert actual.dtype == torch.float64
    torch.testing.assert_close(actual, t64(expected), rtol=1e-9, atol=1e-6)


@pytest.fixture(params=[0, 1, 2])
def rng(request) -> random.Random:
    """A seeded generator; each test runs on three random draws."""
    return random.Random(1000 + request.param)


# ------------------------------------------------------------------------------------------------------ GAE


def ref_gae(rewards, values, mask, gamma, lam):
    advantages, returns = [], []
    for r, v, m in zip(rewards, values, mask):
        next_value, last_gae, adv = 0.0, 0.0, [0.0] * len(r)
        for t in reversed(range(len(r))):
            gae_here = r[t] + gamma * next_value - v[t] + gamma * lam * last_gae
            if m[t]:
                next_value, last_gae = v[t], gae_here
            adv[t] = last_gae
        advantages.append(adv)
        returns.append([a + vv for a, vv in zip(adv, v)])
    return ref_whiten(advantages, mask), returns


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_reference_and_skips_user_turns(rng, gamma, lam):
    mask = random_mask(rng)
    rewards = random_matrix(rng, scale=0.3)
    values = random_matrix(rng)
    adv, ret = compute_gae_advantage_return(t64(rewards), t64(values), torch.tensor(mask), gamma, lam)
    exp_adv, exp_ret = ref_gae(rewards, values, mask, gamma, lam)
    assert_matches(adv, exp_adv)
    assert_matches(ret, exp_ret)


def test_gae_bootstraps_across_a_user_span_by_hand():
    # agent tokens at 0 and 3, user turn at 1-2 (its rewards and values must not matter).
    rewards = [[0.5, 7.0, -3.0, 1.0]]
    values = [[0.2, 100.0, -100.0, 0.4]]
    mask = [[1, 0, 0, 1]]
    _, ret = compute_gae_advantage_return(t64(rewards), t64(values), torch.tensor(mask), 0.9, 0.8)
    adv_3 = 1.0 - 0.4
    adv_0 = (0.5 + 0.9 * 0.4 - 0.2) + 0.9 * 0.8 * adv_3
    assert ret[0, 3].item() == pytest.approx(adv_3 + 0.4, abs=1e-12)
    assert ret[0, 0].item() == pytest.approx(adv_0 + 0.2, abs=1e-12)


def test_gae_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="shape"):
        compute_gae_advantage_return(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), 1.0, 1.0)


# ----------------------------------------------------------------------------------------------------- GRPO


def grouped_index(rng: random.Random) -> list:
    """Two groups of three, one singleton (uid strings as the trainer makes them), shuffled."""
    index = ["a", "a", "a", "b", "b", "b", "solo"]
    rng.shuffle(index)
    return index


def ref_grpo(rewards, mask, index, eps, norm):
    scores = [sum(r) for r in rewards]
    adv = [0.0] * len(scores)
    for rows in ref_groups(index).values():
        group = [scores[i] for i in rows]
        n = len(group)
        mean, std = (0.0, 1.0) if n == 1 else (sum(group) / n, 0.0)
        if n > 1:
            std = math.sqrt(sum((s - mean) ** 2 for s in group) / (n - 1))
        for i in rows:
            adv[i] = (scores[i] - mean) / (std + eps) if norm else scores[i] - mean
    return [[adv[i] * m for m in row] for i, row in enumerate(mask)]


@pytest.mark.parametrize("norm", [True, False], ids=["grpo", "dr_grpo"])
def test_grpo_matches_reference(rng, norm):
    mask, index = random_mask(rng), grouped_index(rng)
    rewards = outcome_rewards(rng, mask)
    adv, ret = compute_grpo_outcome_advantage(
        t64(rewards), torch.tensor(mask), np.array(index, dtype=object), epsilon=1e-6, norm_adv_by_std_in_grpo=norm
    )
    assert_matches(adv, ref_grpo(rewards, mask, index, 1e-6, norm))
    assert torch.equal(adv, ret)


def test_grpo_singleton_group_and_identical_scores():
    rewards = [[0.0, 2.0], [0.0, 1.0], [0.0, 1.0], [3.0, 0.0]]
    adv, _ = compute_grpo_outcome_advantage(t64(rewards), torch.ones(4, 2), [7, 8, 8, 9])
    assert adv[0].tolist() == pytest.approx([2.0 / (1 + 1e-6)] * 2)  # singleton: mean 0, std 1
    assert adv[1:3].abs().max().item() == 0.0  # equal scores in a group carry no signal
    assert adv[3].tolist() == pytest.approx([3.0 / (1 + 1e-6)] * 2)


def test_grpo_index_types_group_by_value(rng):
    mask, index = random_mask(rng), grouped_index(rng)
    rewards = outcome_rewards(rng, mask)
    expected = ref_grpo(rewards, mask, index, 1e-6, True)
    as_ints = [{"a": 0, "b": 1, "solo": 2}[g] for g in index]
    for idx in (index, np.array(as_ints), torch.tensor(as_ints)):
        adv, _ = compute_grpo_outcome_advantage(t64(rewards), torch.tensor(mask), idx)
        assert_matches(adv, expected)


def test_grpo_rejects_index_of_wrong_length():
    with pytest.raises(ValueError, match="index has 2 entries"):
        compute_grpo_outcome_advantage(torch.zeros(3, 4), torch.ones(3, 4), np.array(["a", "a"]))


# ------------------------------------------------------------------------------------------- RLOO / REINFORCE++


def test_rloo_matches_leave_one_out_reference(rng):
    mask, index = random_mask(rng), grouped_index(rng)
    rewards = outcome_rewards(rng, mask)
    scores = [sum(r) for r in rewards]
    expected_scalar = list(scores)
    for rows in ref_groups(index).values():
        if len(rows) > 1:
            for i in rows:
                others = [scores[j] for j in rows if j != i]
                expected_scalar[i] = scores[i] - sum(others) / len(others)
    adv, ret = compute_rloo_outcome_advantage(t64(rewards), torch.tensor(mask), np.array(index, dtype=object))
    assert_matches(adv, [[expected_scalar[i] * m for m in row] for i, row in enumerate(mask)])
    assert torch.equal(adv, ret)


def ref_reinforce_returns(rewards: list[list[float]], mask: list[list[int]], gamma: float) -> list[list[float]]:
    """Discounted reward-to-go over each row's agent tokens only, walking them right to left; 0 elsewhere."""
    returns = []
    for r, m in zip(rewards, mask):
        row, following = [0.0] * len(r), 0.0
        for t in sorted((t for t in range(len(r)) if m[t]), reverse=True):
            following = r[t] + gamma * following
            row[t] = following
        returns.append(row)
    return returns


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_matches_reference(rng, gamma):
    """Random rewards on every position (also on user turns and padding, which must be ignored) with user-turn
    spans in the middle of the rows: each agent token gets the discounted sum of the later agent tokens'
    rewards, across the user turns."""
    mask = random_mask(rng)
    rewards = random_matrix(rng, scale=0.5)
    returns = ref_reinforce_returns(rewards, mask, gamma)
    whitened = ref_whiten(returns, mask)
    expected_adv = [[w * m for w, m in zip(wrow, mrow)] for wrow, mrow in zip(whitened, mask)]
    adv, ret = compute_reinforce_plus_plus_outcome_advantage(t64(rewards), torch.tensor(mask), gamma)
    assert_matches(adv, expected_adv)
    assert_matches(ret, returns)
    adv_cfg, _ = compute_reinforce_plus_plus_outcome_advantage(
        t64(rewards), torch.tensor(mask), config={"gamma": gamma}
    )
    torch.testing.assert_close(adv_cfg, adv, rtol=0, atol=0)


def test_reinforce_plus_plus_outcome_reward_reaches_earlier_agent_turns_by_hand():
    """Two agent turns around a user turn, outcome reward 1 on the last agent token, gamma 0.5: the first
    turn's tokens get 0.5^3 and 0.5^2 (the user turn is neither rewarded nor discounted); before the fix they
    got 0."""
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0]])
    rewards = t64([[0.0, 0.0, 7.0, 7.0, 0.0, 1.0, 5.0]])  # rewards on masked tokens are ignored
    _, returns = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, 0.5)
    assert_matches(returns, [[0.125, 0.25, 0.0, 0.0, 0.5, 1.0, 0.0]])


def test_reinforce_plus_plus_needs_gamma():
    with pytest.raises(ValueError, match="gamma"):
        compute_reinforce_plus_plus_outcome_advantage(torch.zeros(2, 3), torch.ones(2, 3))


def test_reinforce_plus_plus_baseline_matches_reference(rng):
    mask, index = random_mask(rng), grouped_index(rng)
    rewards = outcome_rewards(rng, mask)
    scores = [sum(r) for r in rewards]
    centred = list(scores)
    for rows in ref_groups(index).values():
        if len(rows) > 1:
            mean = sum(scores[i] for i in rows) / len(rows)
            for i in rows:
                centred[i] = scores[i] - mean
    tiled = [[centred[i] * m for m in row] for i, row in enumerate(mask)]
    whitened = ref_whiten(tiled, mask)
    expected = [[w * m for w, m in zip(wrow, mrow)] for wrow, mrow in zip(whitened, mask)]
    adv, ret = compute_reinforce_plus_plus_baseline_outcome_advantage(
        t64(rewards), torch.tensor(mask), np.array(index, dtype=object)
    )
    assert_matches(adv, expected)
    assert torch.equal(adv, ret)


def test_remax_matches_reference(rng):
    mask = random_mask(rng)
    rewards = random_matrix(rng, scale=0.5)
    baselines = [rng.uniform(-1, 1) for _ in range(BS)]
    returns = [[sum(r[k] * m[k] for k in range(t, T)) for t in range(T)] for r, m in zip(rewards, mask)]
    expected = [[ret[t] - b * m[t] for t in range(T)] for ret, b, m in zip(returns, baselines, mask)]
    adv, ret = compute_remax_outcome_advantage(t64(rewards), t64(baselines), torch.tensor(mask))
    assert_matches(adv, expected)
    assert_matches(ret, returns)


def test_remax_rejects_baselines_of_wrong_shape():
    with pytest.raises(ValueError, match="reward_baselines"):
        compute_remax_outcome_advantage(torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3))


# ------------------------------------------------------------------------------------------------- registry


def test_registry_maps_every_estimator_name():
    expected = {
        "gae": compute_gae_advantage_return,
        "grpo": compute_grpo_outcome_advantage,
        "rloo": compute_rloo_outcome_advantage,
        "reinforce_plus_plus": compute_reinforce_plus_plus_outcome_advantage,
        "reinforce_plus_plus_baseline": compute_reinforce_plus_plus_baseline_outcome_advantage,
        "remax": compute_remax_outcome_advantage,
        "grpo_vectorized": core_algos.compute_grpo_vectorized_outcome_advantage,
        "rloo_vectorized": core_algos.compute_rloo_vectorized_outcome_advantage,
        "turn_mixed": core_algos.compute_turn_mixed_advantage,
        "turn_gae": core_algos.compute_turn_gae_advantage_return,
    }
    assert {e.value for e in AdvantageEstimator} == set(expected)
    for name, fn in expected.items():
        assert get_adv_estimator_fn(name) is fn
        assert get_adv_estimator_fn(AdvantageEstimator(name)) is fn


def test_unknown_estimator_lists_registered_names():
    with pytest.raises(ValueError, match="Unknown advantage estimator simply: ppo_magic.*grpo"):
        get_adv_estimator_fn("ppo_magic")


def test_custom_estimator_registration_and_name_clash():
    def my_estimator(token_level_rewards, response_mask, **kwargs):
        return token_level_rewards, token_level_rewards

    try:
        register_adv_est("my_test_estimator")(my_estimator)
        assert get_adv_estimator_fn("my_test_estimator") is my_estimator
        register_adv_est("my_test_estimator")(my_estimator)  # same function again is fine
        with pytest.raises(ValueError, match="already registered"):
            register_adv_est("grpo")(my_estimator)
    finally:
        core_algos.ADV_ESTIMATOR_REGISTRY.pop("my_test_estimator", None)
