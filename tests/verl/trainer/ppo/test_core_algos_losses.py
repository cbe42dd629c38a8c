"""Loss aggregation, PPO policy/value/entropy losses, KL estimators and KL controllers of core_algos, against
independent plain-Python float64 references (no core_algos or torch_functional helpers in the references)."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from omegaconf import OmegaConf

from verl.trainer.ppo import advantages, core_algos, kl
from verl.trainer.ppo.core_algos import (
    agg_loss,
    compute_entropy_loss,
    compute_policy_loss,
    compute_policy_loss_vanilla,
    compute_rewards,
    compute_value_loss,
    get_policy_loss_fn,
)
from verl.trainer.ppo.kl import (
    AdaptiveKLController,
    FixedKLController,
    get_kl_controller,
    kl_penalty,
    kl_penalty_forward,
)

BS, T = 8, 10
MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def random_mask(rng: random.Random, bs: int = BS, length: int = T) -> list[list[int]]:
    """Masks with interior user spans and right padding; rows 2 and 3 fully masked (so one micro-batch of
    the 2 ranks x 2 micro-batches split below holds no loss-carrying token at all)."""
    rows = []
    for i in range(bs):
        row = [0] * length
        if i not in (2, 3):
            used = rng.randint(3, length)
            row[:used] = [1] * used
            start = rng.randint(1, used - 1)
            for t in range(start, min(used - 1, start + rng.randint(0, 3))):
                row[t] = 0
        rows.append(row)
    return rows


def random_matrix(rng: random.Random, scale: float = 1.0, bs: int = BS, length: int = T) -> list[list[float]]:
    """A bs x length matrix of Gaussian floats."""
    return [[rng.gauss(0.0, scale) for _ in range(length)] for _ in range(bs)]


def t64(x) -> torch.Tensor:
    """A float64 tensor of nested lists."""
    return torch.tensor(x, dtype=torch.float64)


def close(actual, expected: float) -> None:
    """Scalar equality to 1e-6 (relative 1e-9 for large values)."""
    assert float(actual) == pytest.approx(expected, rel=1e-9, abs=1e-6)


def ref_agg(loss, mask, mode, dp_size=1, num_tokens=None, num_rows=None, scale=None) -> float:
    """The aggregation modes written out with loops."""
    row_sums = [sum(l * m for l, m in zip(lr, mr)) for lr, mr in zip(loss, mask)]
    row_counts = [sum(mr) for mr in mask]
    if mode == "token-mean":
        n = sum(row_counts) if num_tokens is None else num_tokens
        return sum(row_sums) / (n or 1) * dp_size
    per_row = [s if mode != "seq-mean-token-mean" else s / c for s, c in zip(row_sums, row_counts) if c > 0]
    n = len(per_row) if num_rows is None else num_rows
    seq_mean = sum(per_row) / (n or 1) * dp_size
    if mode == "seq-mean-token-sum-norm":  # Dr.GRPO: the mean token sum over sequences / the horizon
        return seq_mean / (len(mask[0]) if scale is None else scale)
    return seq_mean


@pytest.fixture(params=[0, 1, 2])
def rng(request) -> random.Random:
    """A seeded generator; each test runs on three random draws."""
    return random.Random(2000 + request.param)


# ---------------------------------------------------------------------------------------------------- agg_loss


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_matches_reference(rng, mode):
    loss, mask = random_matrix(rng), random_mask(rng)
    close(agg_loss(t64(loss), torch.tensor(mask), mode), ref_agg(loss, mask, mode))
    close(
        agg_loss(t64(loss), torch.tensor(mask), mode, dp_size=4, batch_num_tokens=37, global_batch_size=11,
                 loss_scale_factor=64),
        ref_agg(loss, mask, mode, dp_size=4, num_tokens=37, num_rows=11, scale=64),
    )


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_is_invariant_to_dp_and_micro_batch_split(rng, mode):
    loss, mask = t64(random_matrix(rng)), torch.tensor(random_mask(rng))
    whole = agg_loss(loss, mask, mode)
    dp_size = 2
    counts = {"batch_num_tokens": int(mask.sum()), "global_batch_size": int((mask.sum(-1) > 0).sum())}
    rank_totals = []
    for rank_rows in (range(0, 4), range(4, 8)):
        rank_rows = list(rank_rows)
        micro_batches = [rank_rows[:2], rank_rows[2:]]
        rank_totals.append(sum(agg_loss(loss[mb], mask[mb], mode, dp_size=dp_size, **counts) for mb in micro_batches))
    # FSDP averages the gradients over the ranks; the loss is linear, so average the rank totals.
    close(sum(rank_totals) / dp_size, whole.item())
    assert torch.isfinite(whole)


def test_agg_loss_with_no_loss_tokens_is_zero_not_nan():
    for mode in MODES:
        out = agg_loss(torch.ones(2, 3, dtype=torch.float64), torch.zeros(2, 3), mode)
        assert out.item() == 0.0


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_ignores_non_finite_values_at_masked_positions(mode):
    """Padding positions may hold inf/NaN (e.g. a log-ratio of -inf log-probs); they carry no loss, so they must
    not turn the aggregate (or its gradient) into NaN."""
    loss = torch.tensor([[1.0, 2.0, float("nan")], [3.0, float("inf"), -float("inf")]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    finite = torch.where(mask.bool(), loss, torch.zeros_like(loss))
    close(agg_loss(loss, mask, mode), agg_loss(finite, mask, mode).item())
    leaf = loss.clone().requires_grad_(True)
    agg_loss(leaf, mask, mode).backward()
    assert torch.isfinite(leaf.grad).all() and (leaf.grad[mask == 0] == 0).all()


def test_agg_loss_rejects_unknown_mode_and_bad_shapes():
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'token-sum'"):
        agg_loss(torch.zeros(2, 3), torch.ones(2, 3), "token-sum")
    with pytest.raises(ValueError, match="loss_mask"):
        agg_loss(torch.zeros(2, 3), torch.ones(2, 4), "token-mean")


# ----------------------------------------------------------------------------------------------- policy loss


def policy_inputs(rng: random.Random):
    """Log-probs whose ratios land inside, above and below the clip range, past the dual-clip bound, and past
    the +-20 clamp of the log-ratio; advantages of both signs."""
    old = [[rng.uniform(-4, -0.1) for _ in range(T)] for _ in range(BS)]
    new = []
    for row in old:
        new_row = []
        for o in row:
            kind = rng.random()
            if kind < 0.5:
                delta = rng.gauss(0, 0.1)
            else:
                delta = rng.uniform(-2.5, 2.5) if kind < 0.95 else rng.choice([-25.0, 25.0])
            new_row.append(o + delta)
        new.append(new_row)
    adv = random_matrix(rng)
    return old, new, adv, random_mask(rng)


def ref_policy(old, new, adv, mask, low, high, c):
    """Per-token dual-clip PPO losses and the three metrics."""
    losses, clipped, lower, kl = [], [], [], []
    for o_row, n_row, a_row in zip(old, new, adv):
        l_row, c_row, low_row, kl_row = [], [], [], []
        for o, n, a in zip(o_row, n_row, a_row):
            log_ratio = min(max(n - o, -20.0), 20.0)
            ratio = math.exp(log_ratio)
            unclipped = -a * ratio
            clipped_loss = -a * min(max(ratio, 1 - low), 1 + high)
            loss = max(unclipped, clipped_loss)
            lower_hit = a < 0 and loss > -a * c
            if a < 0:
                loss = min(loss, -a * c)
            l_row.append(loss)
            c_row.append(1.0 if clipped_loss > unclipped else 0.0)
            low_row.append(1.0 if lower_hit else 0.0)
            kl_row.append(-log_ratio)
        losses.append(l_row)
        clipped.append(c_row)
        lower.append(low_row)
        kl.append(kl_row)
    mean = lambda m: ref_agg(m, mask, "token-mean")  # noqa: E731
    metrics = {"actor/pg_clipfrac": mean(clipped), "actor/ppo_kl": mean(kl), "actor/pg_clipfrac_lower": mean(lower)}
    return losses, metrics


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("low,high,c", [(0.2, 0.2, 3.0), (0.2, 0.28, 3.0), (0.1, 0.4, 1.5)])
def test_policy_loss_matches_reference(rng, mode, low, high, c):
    old, new, adv, mask = policy_inputs(rng)
    loss, metrics = compute_policy_loss_vanilla(
        t64(old), t64(new), t64(adv), torch.tensor(mask), mode, clip_ratio_low=low, clip_ratio_high=high,
        clip_ratio_c=c,
    )
    ref_losses, ref_metrics = ref_policy(old, new, adv, mask, low, high, c)
    close(loss, ref_agg(ref_losses, mask, mode))
    assert set(metrics) == set(ref_metrics)
    for key, value in ref_metrics.items():
        close(metrics[key], value)
    assert metrics["actor/pg_clipfrac"] > 0 and metrics["actor/pg_clipfrac_lower"] > 0  # both clips exercised


def test_policy_loss_gradient_is_zero_on_clipped_tokens(rng):
    old, new, adv, mask = policy_inputs(rng)
    log_prob = t64(new).requires_grad_(True)
    loss, _ = compute_policy_loss_vanilla(t64(old), log_prob, t64(adv), torch.tensor(mask), clip_ratio_high=0.28)
    loss.backward()
    n_tokens = sum(map(sum, mask))
    for i in range(BS):
        for t in range(T):
            lr = new[i][t] - old[i][t]
            ratio, a = math.exp(min(max(lr, -20), 20)), adv[i][t]
            active = -20 < lr < 20 and (1 - 0.2 < ratio < 1 + 0.28 or (a > 0) == (ratio < 1))
            active = active and not (a < 0 and -a * ratio > -a * 3.0)
            expected = -a * ratio / n_tokens if (active and mask[i][t]) else 0.0
            assert log_prob.grad[i, t].item() == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_policy_loss_options_config_and_registry(rng):
    old, new, adv, mask = (t64(x) if i < 3 else torch.tensor(x) for i, x in enumerate(policy_inputs(rng)))
    explicit, _ = compute_policy_loss_vanilla(old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    config = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0})
    via_config, _ = get_policy_loss_fn("vanilla")(old, new, adv, mask, "token-mean", config=config)
    close(via_config, explicit.item())
    weights = t64([[0.5 + (i + t) % 3 for t in range(T)] for i in range(BS)])
    weighted, _ = compute_policy_loss_vanilla(old, new, adv, mask, rollout_is_weights=weights)
    ref_losses, _ = ref_policy(old.tolist(), new.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.2, 3.0)
    ref_weighted = [[l * w for l, w in zip(lr, wr)] for lr, wr in zip(ref_losses, weights.tolist())]
    close(weighted, ref_agg(ref_weighted, mask.tolist(), "token-mean"))
    scaled, _ = compute_policy_loss_vanilla(old, new, adv, mask, dp_size=2, batch_num_tokens=100)
    close(scaled, ref_agg(ref_losses, mask.tolist(), "token-mean", dp_size=2, num_tokens=100))


def test_deprecated_compute_policy_loss_matches_vanilla(rng):
    old, new, adv, mask = (t64(x) if i < 3 else torch.tensor(x) for i, x in enumerate(policy_inputs(rng)))
    vanilla, metrics = compute_policy_loss_vanilla(
        old, new, adv, mask, "seq-mean-token-mean", clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=2.0
    )
    with pytest.warns(DeprecationWarning):
        loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss(
            old, new, adv, mask, cliprange=0.2, cliprange_high=0.28, clip_ratio_c=2.0,
            loss_agg_mode="seq-mean-token-mean",
        )
    close(loss, vanilla.item())
    close(metrics["actor/pg_clipfrac"], float(clipfrac))  # the metrics are detached 0-d tensors
    close(metrics["actor/ppo_kl"], float(ppo_kl))
    close(metrics["actor/pg_clipfrac_lower"], float(clipfrac_lower))


@pytest.mark.parametrize("c", [1.0, 0.5])
def test_dual_clip_bound_must_exceed_one(c):
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss_vanilla(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2),
                                    clip_ratio_c=c)


def test_unknown_policy_loss_lists_registered_names():
    with pytest.raises(ValueError, match="unknown policy loss 'nope'.*vanilla"):
        get_policy_loss_fn("nope")


# ------------------------------------------------------------------------------------------ value / entropy


@pytest.mark.parametrize("mode", MODES)
def test_value_loss_matches_reference(rng, mode):
    vpreds, returns, values, mask = random_matrix(rng), random_matrix(rng), random_matrix(rng), random_mask(rng)
    c = 0.3
    losses, clipped = [], []
    for v_row, r_row, o_row in zip(vpreds, returns, values):
        l_row, c_row = [], []
        for v, r, o in zip(v_row, r_row, o_row):
            v_clip = min(max(v, o - c), o + c)
            l_row.append(max((v - r) ** 2, (v_clip - r) ** 2))
            c_row.append(1.0 if (v_clip - r) ** 2 > (v - r) ** 2 else 0.0)
        losses.append(l_row)
        clipped.append(c_row)
    vf_loss, vf_clipfrac = compute_value_loss(t64(vpreds), t64(returns), t64(values), torch.tensor(mask), c, mode)
    close(vf_loss, 0.5 * ref_agg(losses, mask, mode))
    close(vf_clipfrac, ref_agg(clipped, mask, "token-mean"))
    assert 0 < vf_clipfrac < 1


@pytest.mark.parametrize("mode", MODES)
def test_entropy_loss_matches_reference(rng, mode):
    vocab = 5
    logits = [[[rng.gauss(0, 2) for _ in range(vocab)] for _ in range(T)] for _ in range(BS)]
    mask = random_mask(rng)
    entropies = []
    for row in logits:
        ent_row = []
        for z in row:
            top = max(z)
            log_norm = top + math.log(sum(math.exp(x - top) for x in z))
            ent_row.append(-sum(math.exp(x - log_norm) * (x - log_norm) for x in z))
        entropies.append(ent_row)
    close(compute_entropy_loss(t64(logits), torch.tensor(mask), mode), ref_agg(entropies, mask, mode))


# --------------------------------------------------------------------------------------------------- KL


def ref_kl(name: str, lp: float, ref: float) -> float:
    if name in ("kl", "k1"):
        return lp - ref
    if name == "abs":
        return abs(lp - ref)
    if name in ("mse", "k2"):
        return 0.5 * (lp - ref) ** 2
    x = min(max(ref - lp, -20.0), 20.0)
    return min(max(math.exp(x) - x - 1, -10.0), 10.0)


KL_NAMES = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]


def kl_inputs(rng: random.Random):
    lp = random_matrix(rng, bs=3, length=6)
    ref = [[x + rng.choice([rng.gauss(0, 0.3), rng.gauss(0, 3), 25.0, -25.0]) for x in row] for row in lp]
    return lp, ref


@pytest.mark.parametrize("name", KL_NAMES)
def test_kl_estimators_match_reference(rng, name):
    lp, ref = kl_inputs(rng)
    expected = [[ref_kl(name, a, b) for a, b in zip(ra, rb)] for ra, rb in zip(lp, ref)]
    for fn in (kl_penalty, kl_penalty_forward):
        torch.testing.assert_close(fn(t64(lp), t64(ref), name), t64(expected), rtol=1e-9, atol=1e-6)
    torch.testing.assert_close(kl_penalty_forward(t64(lp), t64(ref), name + "+"), t64(expected), rtol=1e-9, atol=1e-6)


@pytest.mark.parametrize("name", [n + "+" for n in KL_NAMES])
def test_straight_through_kl_has_forward_value_and_k2_gradient(rng, name):
    lp_list, ref_list = kl_inputs(rng)
    lp, ref = t64(lp_list).requires_grad_(True), t64(ref_list).requires_grad_(True)
    out = kl_penalty(lp, ref, name)
    expected = [[ref_kl(name[:-1], a, b) for a, b in zip(ra, rb)] for ra, rb in zip(lp_list, ref_list)]
    torch.testing.assert_close(out.detach(), t64(expected), rtol=1e-9, atol=1e-6)
    out.sum().backward()
    k2_grad = [[a - b for a, b in zip(ra, rb)] for ra, rb in zip(lp_list, ref_list)]
    torch.testing.assert_close(lp.grad, t64(k2_grad), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(ref.grad, -t64(k2_grad), rtol=1e-9, atol=1e-9)


def test_core_algos_re_exports_the_kl_api():
    """veRL code calls ``core_algos.kl_penalty`` / ``core_algos.FixedKLController``: the names live in kl.py."""
    for name in ("kl_penalty", "kl_penalty_forward", "FixedKLController", "AdaptiveKLController", "get_kl_controller"):
        assert getattr(core_algos, name) is getattr(kl, name)
        assert name in core_algos.__all__


def test_core_algos_re_exports_the_advantage_api():
    """veRL code calls ``core_algos.get_adv_estimator_fn`` etc.: every public name of advantages.py is there."""
    assert advantages.__all__
    # core_algos has its own register/get functions (they read core_algos.ADV_ESTIMATOR_REGISTRY at call time, as
    # veRL's tests expect) over the same registry dict
    own = {"register_adv_est", "get_adv_estimator_fn"}
    for name in advantages.__all__:
        assert name in core_algos.__all__
        if name not in own:
            assert getattr(core_algos, name) is getattr(advantages, name)
    assert core_algos.ADV_ESTIMATOR_REGISTRY is advantages.ADV_ESTIMATOR_REGISTRY
    assert core_algos.get_adv_estimator_fn("grpo") is advantages.compute_grpo_outcome_advantage


def test_kl_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"logprob \(2, 3\) and ref_logprob \(2, 4\)"):
        kl_penalty(torch.zeros(2, 3), torch.zeros(2, 4), "low_var_kl")


def test_kl_bad_names():
    with pytest.raises(NotImplementedError):
        kl_penalty(torch.zeros(1, 2), torch.zeros(1, 2), "full")
    with pytest.raises(ValueError, match="unknown kl_penalty 'k4'"):
        kl_penalty(torch.zeros(1, 2), torch.zeros(1, 2), "k4")
    with pytest.raises(ValueError, match="unknown kl_penalty"):
        kl_penalty_forward(torch.zeros(1, 2), torch.zeros(1, 2), "low-var-kl")


def test_compute_rewards_matches_reference(rng):
    scores, old, ref = random_matrix(rng), random_matrix(rng), random_matrix(rng)
    expected = [[s - 0.05 * (o - r) for s, o, r in zip(a, b, c)] for a, b, c in zip(scores, old, ref)]
    actual = compute_rewards(t64(scores), t64(old), t64(ref), 0.05)
    torch.testing.assert_close(actual, t64(expected), rtol=1e-9, atol=1e-9)


# ------------------------------------------------------------------------------------------- KL controllers


def test_fixed_kl_controller_never_moves():
    ctrl = get_kl_controller({"type": "fixed", "kl_coef": 0.01})
    assert isinstance(ctrl, FixedKLController)
    ctrl.update(current_kl=5.0, n_steps=64)
    assert ctrl.value == 0.01


def test_adaptive_kl_controller_matches_reference():
    cfg = OmegaConf.create({"type": "adaptive", "kl_coef": 0.1, "target_kl": 0.05, "horizon": 1000})
    ctrl = get_kl_controller(cfg)
    assert isinstance(ctrl, AdaptiveKLController)
    value = 0.1
    for kl, n in [(0.05, 32), (0.2, 32), (0.051, 16), (0.0, 64), (0.04, 8)]:
        ctrl.update(kl, n)
        value *= 1 + min(max(kl / 0.05 - 1, -0.2), 0.2) * n / 1000
        assert ctrl.value == pytest.approx(value, rel=1e-12)
    assert ctrl.value != 0.1


def test_kl_controller_from_a_dataclass_config():
    @dataclasses.dataclass
    class KLCtrl:
        type: str = "adaptive"
        kl_coef: float = 0.2
        target_kl: float = 0.1
        horizon: float = 100.0

    ctrl = get_kl_controller(KLCtrl())
    assert isinstance(ctrl, AdaptiveKLController) and (ctrl.value, ctrl.target, ctrl.horizon) == (0.2, 0.1, 100.0)
    with pytest.raises(TypeError, match="kl_ctrl"):
        get_kl_controller(None)


def test_kl_controller_bad_config():
    with pytest.raises(ValueError, match="kl_ctrl.type 'pid'"):
        get_kl_controller({"type": "pid", "kl_coef": 0.1})
    with pytest.raises(ValueError, match="horizon"):
        get_kl_controller({"type": "adaptive", "kl_coef": 0.1, "target_kl": 0.1, "horizon": 0})
    with pytest.raises(ValueError, match="target_kl"):
        get_kl_controller({"type": "adaptive", "kl_coef": 0.1})
