"""veRL-style calls (positional orders, metric reduction, registries) give veRL's results on SEAD's engine.

Expected values come from independent float64 loops written here, not from the code under test.
"""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl.trainer.ppo import core_algos
from verl.utils.metric import Metric, reduce_metrics
from verl.utils.torch_functional import logprobs_from_logits


def loop_pg_loss(old, new, adv, mask, low, high, c, dp_size=1, num_tokens=None):
    """Token-mean dual-clip PPO loss, element by element in float64."""
    total, count = 0.0, 0.0
    for i in range(len(old)):
        for t in range(len(old[i])):
            if not mask[i][t]:
                continue
            ratio = math.exp(min(max(new[i][t] - old[i][t], -20.0), 20.0))
            a = adv[i][t]
            loss = max(-a * ratio, -a * min(max(ratio, 1 - low), 1 + high))
            if a < 0:
                loss = min(loss, -a * c)
            total, count = total + loss, count + 1
    return total / (num_tokens if num_tokens is not None else count) * dp_size


@pytest.fixture
def policy_batch():
    gen = torch.Generator().manual_seed(3)
    old = torch.randn(4, 7, generator=gen, dtype=torch.float64)
    new = old + 0.4 * torch.randn(4, 7, generator=gen, dtype=torch.float64)
    adv = torch.randn(4, 7, generator=gen, dtype=torch.float64)
    mask = (torch.rand(4, 7, generator=gen) > 0.3).long()
    mask[:, 0] = 1
    return old, new, adv, mask


def test_policy_loss_takes_config_sixth_positionally(policy_batch):
    old, new, adv, mask = policy_batch
    config = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.1, "clip_ratio_high": 0.28, "clip_ratio_c": 2.5,
                               "global_batch_info": {"dp_size": 2, "batch_num_tokens": 40}})
    loss, metrics = core_algos.compute_policy_loss_vanilla(old, new, adv, mask, "token-mean", config)
    expected = loop_pg_loss(old.tolist(), new.tolist(), adv.tolist(), mask.tolist(), 0.1, 0.28, 2.5, 2, 40)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}
    # the registry hands out the same function, called the veRL way
    loss_fn = core_algos.get_policy_loss_fn("vanilla")
    assert loss_fn(old, new, adv, mask, "token-mean", config)[0].item() == pytest.approx(expected, rel=1e-12)


def test_policy_loss_rejects_a_clip_ratio_where_config_goes(policy_batch):
    old, new, adv, mask = policy_batch
    with pytest.raises(TypeError, match="6th positional argument is `config`"):
        core_algos.compute_policy_loss_vanilla(old, new, adv, mask, "token-mean", 0.2)


def test_custom_policy_loss_gets_global_batch_info(policy_batch):
    old, new, adv, mask = policy_batch
    seen = {}

    @core_algos.register_policy_loss("compat_test_loss")
    def my_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                rollout_is_weights=None):
        seen.update(config.global_batch_info)
        return core_algos.agg_loss(-advantages * log_prob, response_mask, loss_agg_mode,
                                   **config.global_batch_info), {}

    try:
        config = OmegaConf.create({"global_batch_info": {"dp_size": 1, "batch_num_tokens": 10}})
        loss, _ = core_algos.get_policy_loss_fn("compat_test_loss")(old, new, adv, mask, "token-mean", config)
        expected = sum(-a * lp for ar, lr, mr in zip(adv.tolist(), new.tolist(), mask.tolist())
                       for a, lp, m in zip(ar, lr, mr) if m) / 10
        assert loss.item() == pytest.approx(expected, rel=1e-12)
        assert seen == {"dp_size": 1, "batch_num_tokens": 10}
    finally:
        core_algos.POLICY_LOSS_REGISTRY.pop("compat_test_loss")


def test_logprobs_from_logits_third_positional_is_inplace_backward():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 11, (3, 5), generator=gen)
    for inplace_backward in (True, False):
        out = logprobs_from_logits(logits, labels, inplace_backward)
        for i in range(3):
            for t in range(5):
                row = logits[i, t].tolist()
                lse = math.log(sum(math.exp(z) for z in row))
                assert out[i, t].item() == pytest.approx(row[labels[i, t]] - lse, rel=1e-12)
    assert torch.equal(logprobs_from_logits(logits, labels, chunk_size=2), logprobs_from_logits(logits, labels))
    with pytest.raises(TypeError, match="3rd positional argument is `inplace_backward`"):
        logprobs_from_logits(logits, labels, 4)


def test_reduce_metrics_takes_max_of_max_keys_and_min_of_min_keys():
    out = reduce_metrics({"response_length/max": [10, 50, 30], "response_length/min": [10, 50, 30],
                          "response_length/mean": [10, 50, 30], "actor/pg_loss": [torch.tensor(1.0), 2.0],
                          "custom": Metric("sum", [1.0, 2.0]), "empty": []})
    assert out["response_length/max"] == 50 and out["response_length/min"] == 10
    assert out["response_length/mean"] == 30 and out["actor/pg_loss"] == 1.5 and out["custom"] == 3.0
    assert math.isnan(out["empty"])


def test_metric_aggregate_dp_means_positions_then_reduces():
    ranks = [Metric("sum", [1.0, 2.0]), Metric("sum", [3.0, 6.0])]
    assert Metric.aggregate_dp(ranks) == (1 + 3) / 2 + (2 + 6) / 2
    assert Metric.aggregate_dp([Metric("max", [1.0, 7.0]), Metric("max", [3.0, 4.0])]) == 7.0


def test_core_algos_registry_lookup_follows_the_module_attribute():
    original = core_algos.ADV_ESTIMATOR_REGISTRY
    try:
        core_algos.ADV_ESTIMATOR_REGISTRY = {"gae": lambda x: 2 * x}
        assert core_algos.get_adv_estimator_fn("gae")(5) == 10

        @core_algos.register_adv_est("compat_est")
        def est():
            return None

        assert core_algos.ADV_ESTIMATOR_REGISTRY["compat_est"] is est and "compat_est" not in original
        with pytest.raises(ValueError, match="Unknown advantage estimator simply: nope"):
            core_algos.get_adv_estimator_fn("nope")
    finally:
        core_algos.ADV_ESTIMATOR_REGISTRY = original


def loop_group_advantages(scores, index, kind, eps=1e-6):
    """GRPO ((s - mean) / (std + eps), group of one: mean 0, std 1) or RLOO (s - mean of the others) per row."""
    out = []
    for s, g in zip(scores, index):
        group = [x for x, h in zip(scores, index) if h == g]
        n = len(group)
        if kind == "grpo":
            mean = sum(group) / n if n > 1 else 0.0
            std = math.sqrt(sum((x - mean) ** 2 for x in group) / (n - 1)) if n > 1 else 1.0
            out.append((s - mean) / (std + eps))
        else:
            out.append((s - (sum(group) - s) / (n - 1)) if n > 1 else s)
    return out


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_vectorized_estimators_match_a_loop_with_string_ids_and_singletons(kind):
    gen = torch.Generator().manual_seed(7)
    rewards = torch.randn(9, 6, generator=gen, dtype=torch.float64)
    mask = (torch.rand(9, 6, generator=gen) > 0.4).to(torch.float64)
    index = np.array(["a", "b", "a", "c", "b", "a", "d", "b", "c"], dtype=object)  # "d" is a group of one
    fn = core_algos.get_adv_estimator_fn(f"{kind}_vectorized")
    adv, ret = fn(token_level_rewards=rewards, response_mask=mask, index=index)
    expected = loop_group_advantages(rewards.sum(-1).tolist(), index.tolist(), kind)
    for i in range(9):
        for t in range(6):
            assert adv[i, t].item() == pytest.approx(expected[i] * mask[i, t].item(), rel=1e-9, abs=1e-12)
    assert torch.equal(adv, ret)


@pytest.mark.processes
def test_import_verl_stays_light_and_exports_dataproto():
    code = ("import sys, verl; assert 'torch' not in sys.modules, 'torch imported'; "
            "from verl import DataProto; from verl.protocol import DataProto as D; assert DataProto is D")
    subprocess.run([sys.executable, "-c", code], check=True)
