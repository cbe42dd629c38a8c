"""``seq-mean-token-sum-norm`` (Dr.GRPO) loss aggregation by hand: the mean over sequences of the per-sequence
token sums divided by the horizon T (veRL >= 0.8.0), also split across ranks with the global sequence count."""

from __future__ import annotations

import pytest
import torch

from verl.trainer.ppo.core_algos import agg_loss


def test_dr_grpo_norm_is_the_mean_over_sequences_of_token_sums_over_the_horizon_by_hand():
    """Rows with 3 and 1 loss tokens of loss 1, an empty row, T = 4: (3 + 1) / 2 sequences / 4 = 0.5 (the old
    sum / T gave 1.0); with a constant loss_scale_factor of 8: 0.25; across 2 ranks with the global count of
    2 non-empty sequences each rank's share is its sum / 2 * 2 / 4 and the rank mean is 0.5 again."""
    loss = torch.ones(3, 4, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 1], [0, 1, 0, 0], [0, 0, 0, 0]])
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(0.5)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=8).item() == pytest.approx(0.25)
    shares = [agg_loss(loss[rows], mask[rows], "seq-mean-token-sum-norm", dp_size=2, global_batch_size=2)
              for rows in ([0], [1, 2])]
    assert shares[0].item() == pytest.approx(0.75) and shares[1].item() == pytest.approx(0.25)
    assert (sum(shares) / 2).item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="loss_scale_factor must be > 0"):
        agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=0)
