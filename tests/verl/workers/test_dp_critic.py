"""In-process tests of DataParallelPPOCritic on the tiny model (no torch.distributed)."""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoConfig, AutoModelForTokenClassification

from verl.protocol import DP_PAD_ROWS_KEY
from verl.workers.critic.dp_critic import DataParallelPPOCritic

from tests.helpers.ppo_batch_helpers import RESPONSE_LEN, make_ppo_batch


@pytest.fixture(scope="module")
def value_model(tiny_model_path):
    """The tiny backbone with a scalar value head (seeded), in fp32, without dropout (as the worker builds it)."""
    config = AutoConfig.from_pretrained(tiny_model_path)
    config.num_labels, config.classifier_dropout = 1, 0.0
    torch.manual_seed(0)
    return AutoModelForTokenClassification.from_pretrained(tiny_model_path, config=config, dtype=torch.float32)


def _critic(value_model, rows: int, micro: int, **overrides) -> DataParallelPPOCritic:
    """A critic with plain SGD (its step is lr * gradient) on a private copy of the value model."""
    cfg = OmegaConf.create(
        {"ppo_mini_batch_size": rows, "ppo_micro_batch_size_per_gpu": micro, "ppo_epochs": 1, "shuffle": False,
         "cliprange_value": 0.2, "loss_agg_mode": "token-mean", "grad_clip": 1.0, **overrides}
    )  # fmt: skip
    module = copy.deepcopy(value_model)
    return DataParallelPPOCritic(cfg, module, torch.optim.SGD(module.parameters(), lr=0.1))


def _params(critic: DataParallelPPOCritic) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in critic.critic_module.named_parameters()}


def test_values_are_read_at_the_position_before_each_response_token(value_model):
    critic = _critic(value_model, rows=4, micro=2)
    data = make_ppo_batch(4, value_model.config.vocab_size, seed=2)
    data.meta_info["micro_batch_size"] = 3
    values = critic.compute_values(data)
    b = data.batch
    with torch.no_grad():
        logits = value_model(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
        ).logits[..., 0]
    expected = logits[:, -RESPONSE_LEN - 1 : -1] * b["response_mask"]
    torch.testing.assert_close(values, expected, atol=1e-5, rtol=1e-5)


def test_dp_padding_rows_carry_no_loss(value_model):
    """A padding row of the DP dispatch changes neither the value loss nor the step."""
    data = make_ppo_batch(3, value_model.config.vocab_size, seed=12)
    padded = data.select_idxs([0, 1, 2, 0])
    padded.meta_info[DP_PAD_ROWS_KEY] = 1
    results = []
    for batch, rows in ((data, 3), (padded, 4)):
        critic = _critic(value_model, rows=rows, micro=rows)
        metrics = critic.update_critic(batch)
        results.append((_params(critic), metrics))
    (expected, expected_metrics), (got, got_metrics) = results
    for name in ("critic/vf_loss", "critic/grad_norm", "critic/vf_clipfrac"):
        assert got_metrics[name][0] == pytest.approx(expected_metrics[name][0], rel=1e-5, abs=1e-7), name
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=1e-5)


def test_dr_grpo_value_loss_is_the_mean_sequence_token_sum_over_the_horizon(value_model):
    """seq-mean-token-sum-norm value loss: 0.5 * mean over sequences of the token sums of the (unclipped at the
    old values) squared errors / T, computed here from the critic's own values; loss_scale_factor replaces T."""
    data = make_ppo_batch(4, value_model.config.vocab_size, seed=4)
    data.meta_info["micro_batch_size"] = 4
    critic = _critic(value_model, rows=4, micro=2, loss_agg_mode="seq-mean-token-sum-norm")
    data.batch["values"] = critic.compute_values(data)  # v_pred == v_old at the first step: no clipping
    errors = ((data.batch["values"].double() - data.batch["returns"].double()) ** 2) * data.batch["response_mask"]
    expected = 0.5 * float(errors.sum(-1).mean()) / RESPONSE_LEN
    assert critic.update_critic(data)["critic/vf_loss"][0] == pytest.approx(expected, rel=1e-5)
    scaled = _critic(value_model, rows=4, micro=2, loss_agg_mode="seq-mean-token-sum-norm",
                     loss_scale_factor=2 * RESPONSE_LEN)
    assert scaled.update_critic(data)["critic/vf_loss"][0] == pytest.approx(expected / 2, rel=1e-5)
