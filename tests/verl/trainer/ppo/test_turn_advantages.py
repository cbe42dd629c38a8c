"""The turn-level estimators (turn_mixed, turn_gae) against independent float64 references: plain Python loops
over random dialogues (agent turns broken by user turns, dialogues that end on a user turn, right padding, an
error row without agent tokens, groups of one). Each reference check is also shown to fail on a deliberately
wrong variant (credit leaking into user spans, the wrong normalisation group, token- instead of turn-level GAE,
the value read at the wrong token), so the checks have teeth."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from verl.errors import ContractError
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.advantages_turn import (
    compute_turn_gae_advantage_return,
    compute_turn_mixed_advantage,
    normalise_turns_in_groups,
)
from verl.trainer.ppo.turn_layout import TurnLayout
from verl.utils.agent_turns import agent_turn_ids_from_mask

LENGTH = 40
EPS = 1e-6


# --------------------------------------------------------------------------------------- random dialogues
def random_dialogue_mask(rng: random.Random, length: int = LENGTH) -> list[int]:
    """One row: agent turns (1) and user turns (0) alternating, maybe opening or closing on a user turn, padded."""
    row: list[int] = []
    agent = rng.random() < 0.85  # most responses open with the agent's turn
    for _ in range(rng.randint(1, 9)):
        span = rng.randint(1, 4)
        if len(row) + span > length:
            break
        row += [1 if agent else 0] * span
        agent = not agent
    return row + [0] * (length - len(row))


def runs(mask_row: list[int]) -> list[list[int]]:
    """The positions of each maximal run of 1s (the agent turns), in order."""
    turns: list[list[int]] = []
    for t, m in enumerate(mask_row):
        if m and (t == 0 or not mask_row[t - 1]):
            turns.append([])
        if m:
            turns[-1].append(t)
    return turns


def random_batch(rng: random.Random):
    """Masks (row 2 without agent tokens), groups with a group of one, outcome rewards with noise (also on user
    tokens), per-turn scores on one or two tokens of each turn, values everywhere."""
    index = ["a", "a", "b", "a", "b", "c", "b", "d", "d", "d"]
    mask = [random_dialogue_mask(rng) for _ in index]
    mask[2] = [0] * LENGTH
    if not any(mask[5]):  # the group of one keeps an agent turn
        mask[5][0] = 1
    rewards, turn_scores = [], []
    for row in mask:
        r = [rng.uniform(-0.2, 0.2) if rng.random() < 0.15 else 0.0 for _ in row]
        s = [0.0] * len(row)
        turns = runs(row)
        if turns:
            r[turns[-1][-1]] += rng.choice([0.0, 1.0, 10.0])
        for turn in turns:
            s[turn[-1]] += rng.uniform(-1.0, 1.0)
            if len(turn) > 1 and rng.random() < 0.5:
                s[turn[0]] += rng.uniform(-0.5, 0.5)
        rewards.append(r)
        turn_scores.append(s)
    values = [[rng.gauss(0.0, 1.0) for _ in range(LENGTH)] for _ in index]
    return mask, index, rewards, turn_scores, values


def t64(x) -> torch.Tensor:
    """A float64 tensor of nested lists."""
    return torch.tensor(x, dtype=torch.float64)


def ids_tensor(turns_per_row: list[list[list[int]]], length: int = LENGTH) -> torch.Tensor:
    """(bs, R) agent-turn ids from explicit per-row turns (lists of positions); -1 elsewhere."""
    ids = torch.full((len(turns_per_row), length), -1, dtype=torch.long)
    for i, turns in enumerate(turns_per_row):
        for k, turn in enumerate(turns):
            ids[i, turn] = k
    return ids


def assert_close(actual: torch.Tensor, expected: list[list[float]]) -> None:
    """Equal to the float64 reference (1e-9 relative, 1e-9 absolute)."""
    torch.testing.assert_close(actual.double(), t64(expected), rtol=1e-9, atol=1e-9)


@pytest.fixture(params=[0, 1, 2, 3])
def rng(request) -> random.Random:
    """A seeded generator; each test runs on four random batches."""
    return random.Random(2600 + request.param)


# ------------------------------------------------------------------------------------------------ references
def ref_normalise(values: list[float], scale_by_std: bool) -> list[float]:
    """GRPO's group rule: (v - mean) / (unbiased std + eps), or v - mean; a single value uses mean 0, std 1."""
    if len(values) == 1:
        mean, std = 0.0, 1.0
    else:
        mean = math.fsum(values) / len(values)
        std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return [(v - mean) / (std + EPS) if scale_by_std else v - mean for v in values]


def ref_turn_mixed(rewards, turn_scores, index, turns, beta, scale_by_std=True):
    """A_outcome (GRPO of the row's summed rewards, all positions) + beta * the turn's summed turn_scores
    normalised over the turns of the row's group, on the turn's tokens; 0 elsewhere."""
    out = [[0.0] * LENGTH for _ in rewards]
    for group in dict.fromkeys(index):
        rows = [i for i, g in enumerate(index) if g == group]
        outcome = dict(zip(rows, ref_normalise([math.fsum(rewards[i]) for i in rows], scale_by_std)))
        pool = [(i, turn, math.fsum(turn_scores[i][t] for t in turn)) for i in rows for turn in turns[i]]
        if not pool:
            continue
        for (i, turn, _), z in zip(pool, ref_normalise([p[2] for p in pool], scale_by_std)):
            for t in turn:
                out[i][t] = outcome[i] + beta * z
    return out


def ref_whiten_on_turns(advantages, turns):
    """Whiten over the agent tokens (unbiased variance, +1e-8 inside the rsqrt, as masked_whiten); 0 elsewhere."""
    picked = [advantages[i][t] for i, row in enumerate(turns) for turn in row for t in turn]
    mean = math.fsum(picked) / len(picked)
    var = math.fsum((v - mean) ** 2 for v in picked) / (len(picked) - 1)
    out = [[0.0] * LENGTH for _ in advantages]
    for i, row in enumerate(turns):
        for turn in row:
            for t in turn:
                out[i][t] = (advantages[i][t] - mean) / math.sqrt(var + 1e-8)
    return out


def ref_turn_gae(rewards, values, turns, gamma, lam, turn_scores=None, value_token=0):
    """Per row, GAE over its turns right to left: r_k = sum over the turn of rewards (+ turn_scores),
    V_k = values at the turn's first token (``value_token`` picks another one for the wrong variant)."""
    raw = [[0.0] * LENGTH for _ in rewards]
    returns = [[0.0] * LENGTH for _ in rewards]
    for i, row in enumerate(turns):
        next_value = next_advantage = 0.0
        for turn in reversed(row):
            reward = math.fsum(rewards[i][t] + (turn_scores[i][t] if turn_scores else 0.0) for t in turn)
            value = values[i][turn[value_token]]
            advantage = reward + gamma * next_value - value + gamma * lam * next_advantage
            for t in turn:
                raw[i][t], returns[i][t] = advantage, advantage + value
            next_value, next_advantage = value, advantage
    return ref_whiten_on_turns(raw, turns), returns


def leak_into_user_spans(advantages: torch.Tensor, mask: list[list[int]]) -> torch.Tensor:
    """Wrong variant: user/padding tokens after a turn inherit that turn's advantage."""
    leaked = advantages.clone()
    for i, row in enumerate(mask):
        for t in range(1, LENGTH):
            if not row[t]:
                leaked[i, t] = leaked[i, t - 1]
    return leaked


# ------------------------------------------------------------------------------------------------- turn_mixed
@pytest.mark.parametrize("beta,scale_by_std", [(1.0, True), (0.3, True), (2.0, False)])
def test_turn_mixed_matches_float64_reference(rng, beta, scale_by_std):
    mask, index, rewards, turn_scores, _ = random_batch(rng)
    turns = [runs(row) for row in mask]
    adv, ret = compute_turn_mixed_advantage(t64(rewards), torch.tensor(mask), np.array(index, dtype=object),
                                            turn_scores=t64(turn_scores), turn_weight=beta,
                                            norm_adv_by_std_in_grpo=scale_by_std)
    expected = ref_turn_mixed(rewards, turn_scores, index, turns, beta, scale_by_std)
    assert_close(adv, expected)
    assert torch.equal(adv, ret)
    assert bool((adv[torch.tensor(mask) == 0] == 0).all()), "credit on user or padding tokens"


def test_turn_mixed_check_fails_on_wrong_variants(rng):
    mask, index, rewards, turn_scores, _ = random_batch(rng)
    turns = [runs(row) for row in mask]
    expected = ref_turn_mixed(rewards, turn_scores, index, turns, 1.0)
    mask_t, index_np = torch.tensor(mask), np.array(index, dtype=object)
    right, _ = compute_turn_mixed_advantage(t64(rewards), mask_t, index_np, turn_scores=t64(turn_scores),
                                            turn_weight=1.0)
    with pytest.raises(AssertionError):  # credit leaking into user spans
        assert_close(leak_into_user_spans(right, mask), expected)
    outcome, _ = core_algos.compute_grpo_outcome_advantage(t64(rewards), mask_t, index_np)
    layout = TurnLayout.from_turn_ids(agent_turn_ids_from_mask(mask_t))
    turn_rewards = layout.sum_per_turn(t64(turn_scores))
    for wrong_groups in (torch.zeros(len(index), dtype=torch.long),  # normalised across the whole batch
                         torch.arange(len(index))):  # normalised within each dialogue only
        wrong = outcome + layout.to_tokens(normalise_turns_in_groups(turn_rewards, layout.present, wrong_groups))
        with pytest.raises(AssertionError):
            assert_close(wrong, expected)


def test_turn_mixed_with_zero_weight_is_grpo(rng):
    mask, index, rewards, turn_scores, _ = random_batch(rng)
    index_np = np.array(index, dtype=object)
    adv, _ = compute_turn_mixed_advantage(t64(rewards), torch.tensor(mask), index_np, turn_scores=t64(turn_scores),
                                          turn_weight=0.0)
    grpo, _ = core_algos.compute_grpo_outcome_advantage(t64(rewards), torch.tensor(mask), index_np)
    assert torch.equal(adv, grpo)


def test_turn_mixed_follows_the_loops_turn_ids_over_the_mask_runs(rng):
    mask, index, rewards, turn_scores, _ = random_batch(rng)
    turns = []
    for row in mask:  # the loop says two adjacent agent turns where the mask shows one run (no user tokens between)
        split = []
        for turn in runs(row):
            split += [turn[:1], turn[1:]] if len(turn) > 1 else [turn]
        turns.append(split)
    adv, _ = compute_turn_mixed_advantage(t64(rewards), torch.tensor(mask), np.array(index, dtype=object),
                                          turn_scores=t64(turn_scores), agent_turn_ids=ids_tensor(turns),
                                          turn_weight=1.0)
    assert_close(adv, ref_turn_mixed(rewards, turn_scores, index, turns, 1.0))


def test_turn_mixed_reads_the_weight_from_the_config_and_checks_its_inputs():
    mask = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 1]])
    rewards = t64([[0, 0, 0, 1.0], [0, 0, 0, 0.0]])
    scores = t64([[0, 0.5, 0, -0.5], [1.0, 0, 0, 0.0]])
    index = np.array(["g", "g"], dtype=object)
    from_config, _ = compute_turn_mixed_advantage(rewards, mask, index, turn_scores=scores,
                                                  config={"turn_mixed": {"turn_weight": 0.5}})
    explicit, _ = compute_turn_mixed_advantage(rewards, mask, index, turn_scores=scores, turn_weight=0.5)
    assert torch.equal(from_config, explicit)
    with pytest.raises(ContractError, match="turn_scores"):
        compute_turn_mixed_advantage(rewards, mask, index, turn_scores=None, turn_weight=1.0)
    with pytest.raises(ContractError, match="off the agent turns"):
        compute_turn_mixed_advantage(rewards, mask, index, turn_scores=t64([[0, 0, 2.0, 0], [0] * 4]),
                                     turn_weight=1.0)
    with pytest.raises(ContractError, match="NaN or inf"):
        compute_turn_mixed_advantage(rewards, mask, index, turn_scores=t64([[math.nan, 0, 0, 0], [0] * 4]),
                                     turn_weight=1.0)
    for bad in (math.nan, math.inf, -0.5, None):
        with pytest.raises(ValueError, match="turn_weight"):
            compute_turn_mixed_advantage(rewards, mask, index, turn_scores=scores, turn_weight=bad)
    with pytest.raises(ContractError, match="agent_turn_ids must be >= 0 exactly where"):
        compute_turn_mixed_advantage(rewards, mask, index, turn_scores=scores, turn_weight=1.0,
                                     agent_turn_ids=torch.tensor([[0, 0, 0, 1], [0, -1, 1, 1]]))


# --------------------------------------------------------------------------------------------------- turn_gae
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.95, 0.9), (0.8, 0.0)])
def test_turn_gae_matches_float64_reference(rng, gamma, lam):
    mask, _, rewards, turn_scores, values = random_batch(rng)
    turns = [runs(row) for row in mask]
    adv, ret = compute_turn_gae_advantage_return(t64(rewards), t64(values), torch.tensor(mask), gamma, lam,
                                                 turn_scores=t64(turn_scores))
    exp_adv, exp_ret = ref_turn_gae(rewards, values, turns, gamma, lam, turn_scores)
    assert_close(adv, exp_adv)
    assert_close(ret, exp_ret)
    without, _ = compute_turn_gae_advantage_return(t64(rewards), t64(values), torch.tensor(mask), gamma, lam)
    assert_close(without, ref_turn_gae(rewards, values, turns, gamma, lam)[0])


def test_turn_gae_check_fails_on_wrong_variants(rng):
    mask, _, rewards, turn_scores, values = random_batch(rng)
    turns = [runs(row) for row in mask]
    exp_adv, _ = ref_turn_gae(rewards, values, turns, 0.95, 0.9, turn_scores)
    right, _ = compute_turn_gae_advantage_return(t64(rewards), t64(values), torch.tensor(mask), 0.95, 0.9,
                                                 turn_scores=t64(turn_scores))
    with pytest.raises(AssertionError):  # credit leaking into user spans
        assert_close(leak_into_user_spans(right, mask), exp_adv)
    token_level, _ = core_algos.compute_gae_advantage_return(t64(rewards) + t64(turn_scores), t64(values),
                                                             torch.tensor(mask), 0.95, 0.9)
    with pytest.raises(AssertionError):  # token-level GAE (discounting every token, not every turn)
        assert_close(token_level * torch.tensor(mask), exp_adv)
    wrong_value, _ = ref_turn_gae(rewards, values, turns, 0.95, 0.9, turn_scores, value_token=-1)
    with pytest.raises(AssertionError):  # the turn's value read at its last token instead of its first
        assert_close(right, wrong_value)


def test_turn_gae_by_hand_skips_the_user_turn_and_ignores_its_rewards_and_values():
    # agent turn 0 at positions 0-1, user turn at 2-3 (reward and values there must not matter), agent turn 1 at 4.
    rewards = t64([[0.0, 0.5, 7.0, -3.0, 1.0]])
    scores = t64([[0.0, 0.25, 0.0, 0.0, 0.0]])
    values = t64([[0.2, 9.0, 100.0, -100.0, 0.4]])
    mask = torch.tensor([[1, 1, 0, 0, 1]])
    _, ret = compute_turn_gae_advantage_return(rewards, values, mask, 0.9, 0.8, turn_scores=scores)
    adv_1 = 1.0 - 0.4
    adv_0 = (0.5 + 0.25 + 0.9 * 0.4 - 0.2) + 0.9 * 0.8 * adv_1
    assert ret[0].tolist() == pytest.approx([adv_0 + 0.2, adv_0 + 0.2, 0.0, 0.0, adv_1 + 0.4], abs=1e-12)


def test_turn_gae_skips_a_turn_id_without_tokens_and_follows_given_ids(rng):
    mask, _, rewards, turn_scores, values = random_batch(rng)
    turns = [runs(row) for row in mask]
    ids = ids_tensor(turns)
    gapped = torch.where(ids >= 1, ids + 1, ids)  # turn id 1 has no tokens in any row: the scan steps over it
    adv, ret = compute_turn_gae_advantage_return(t64(rewards), t64(values), torch.tensor(mask), 0.9, 0.7,
                                                 agent_turn_ids=gapped, turn_scores=t64(turn_scores))
    exp_adv, exp_ret = ref_turn_gae(rewards, values, turns, 0.9, 0.7, turn_scores)
    assert_close(adv, exp_adv)
    assert_close(ret, exp_ret)


def test_turn_gae_takes_gamma_and_lam_from_the_config():
    mask = torch.tensor([[1, 0, 1, 1], [1, 1, 0, 1]])
    rewards, values = t64([[0, 0, 0, 1.0], [0, 1.0, 0, 0]]), t64([[0.1, 0, 0.3, 0.2], [0.5, 0.1, 0, 0.2]])
    from_config = compute_turn_gae_advantage_return(rewards, values, mask, config={"gamma": 0.9, "lam": 0.5})
    explicit = compute_turn_gae_advantage_return(rewards, values, mask, 0.9, 0.5)
    assert all(torch.equal(a, b) for a, b in zip(from_config, explicit))
    with pytest.raises(ValueError, match="gamma"):
        compute_turn_gae_advantage_return(rewards, values, mask)


# ------------------------------------------------------------------------------------------------ the layout
def test_turn_layout_views():
    ids = torch.tensor([[0, 0, -1, 1, -1, -1], [-1, -1, -1, -1, -1, -1], [0, -1, 2, 2, -1, 3]])
    layout = TurnLayout.from_turn_ids(ids)
    assert layout.num_turns == 4
    assert layout.present.tolist() == [[True, True, False, False], [False] * 4, [True, False, True, True]]
    assert layout.first_token.tolist() == [[0, 3, 0, 0], [0, 0, 0, 0], [0, 0, 2, 5]]
    assert layout.turn_counts().tolist() == [2, 0, 4]
    tokens = torch.arange(1.0, 7.0).expand(3, 6)
    assert layout.sum_per_turn(tokens).tolist() == [[3.0, 4.0, 0, 0], [0] * 4, [1.0, 0, 7.0, 6.0]]
    assert layout.at_first_token(tokens).tolist() == [[1.0, 4.0, 0, 0], [0] * 4, [1.0, 0, 3.0, 6.0]]
    per_turn = torch.tensor([[10.0, 20.0, 30.0, 40.0]]).expand(3, 4)
    assert layout.to_tokens(per_turn).tolist() == [[10, 10, 0, 20, 0, 0], [0] * 6, [10, 0, 30, 30, 0, 40]]
    empty = TurnLayout.from_turn_ids(torch.full((2, 3), -1))
    assert empty.num_turns == 0 and empty.sum_per_turn(torch.ones(2, 3)).shape == (2, 0)
    assert empty.to_tokens(torch.zeros(2, 0)).tolist() == [[0.0] * 3] * 2
    with pytest.raises(ContractError):
        TurnLayout.from_turn_ids(torch.tensor([[0, -2]]))
