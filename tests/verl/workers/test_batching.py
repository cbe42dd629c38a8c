"""Mini-batch iteration and loss-normalisation counts shared by the actor and the critic."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from verl.protocol import DP_PAD_ROWS_KEY, DataProto
from verl.workers.batching import (
    check_divisible,
    global_loss_info,
    iter_mini_batches,
    mask_padding_rows,
    response_logits,
    select_batch,
)


def test_global_loss_info_without_distributed_counts_tokens_and_non_empty_rows():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert global_loss_info(mask) == {"dp_size": 1, "batch_num_tokens": 3.0, "global_batch_size": 2.0,
                                      "loss_scale_factor": None}
    assert global_loss_info(mask, 512.0)["loss_scale_factor"] == 512.0


def test_iter_mini_batches_epochs_and_shuffle():
    batch = TensorDict({"x": torch.arange(6)}, batch_size=[6])
    plain = [mb["x"].tolist() for mb in iter_mini_batches(batch, 2, epochs=2, shuffle=False)]
    assert plain == [[0, 1], [2, 3], [4, 5]] * 2
    torch.manual_seed(0)
    shuffled = [mb["x"] for mb in iter_mini_batches(batch, 3, epochs=2, shuffle=True)]
    assert len(shuffled) == 4
    assert sorted(torch.cat(shuffled[:2]).tolist()) == list(range(6))
    assert sorted(torch.cat(shuffled[2:]).tolist()) == list(range(6))


def test_response_logits_are_a_shifted_view_in_the_models_dtype():
    logits = torch.arange(2 * 5 * 3, dtype=torch.bfloat16).view(2, 5, 3)
    out = response_logits(logits, response_length=2)
    assert torch.equal(out, logits[:, 2:4]) and out.dtype == torch.bfloat16
    assert out.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()  # no copy
    with pytest.raises(ValueError, match="responses of length 5 do not fit in input_ids of length 5"):
        response_logits(logits, 5)


def test_select_batch_and_divisibility_errors_name_the_problem():
    data = DataProto.from_dict(tensors={"a": torch.zeros(4, 2)})
    assert list(select_batch(data, ["a"], "here").keys()) == ["a"]
    with pytest.raises(KeyError, match=r"here: batch is missing \['b'\]"):
        select_batch(data, ["a", "b"], "here")
    with pytest.raises(ValueError, match="not divisible by k=3"):
        check_divisible(4, 3, "k", "here")


def test_mask_padding_rows_zeroes_the_trailing_rows_only():
    mask = torch.ones(4, 3, dtype=torch.long)
    data = DataProto.from_dict(tensors={"response_mask": mask, "x": torch.arange(4)}, meta_info={DP_PAD_ROWS_KEY: 2})
    out = mask_padding_rows(data, "here")
    assert out.batch["response_mask"].tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 0], [0, 0, 0]]
    assert torch.equal(out.batch["x"], data.batch["x"]) and data.batch["response_mask"].eq(1).all()
    unpadded = DataProto.from_dict(tensors={"response_mask": mask})
    assert mask_padding_rows(unpadded, "here") is unpadded
    data.meta_info[DP_PAD_ROWS_KEY] = 5
    with pytest.raises(ValueError, match=r"here: meta_info\['dp_pad_rows'\]=5 is outside"):
        mask_padding_rows(data, "here")
