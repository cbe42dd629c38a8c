"""The built-in repeat-letter task: deterministic data files and a hand-checkable reward."""
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from verl.protocol import DataProto
from verl.tasks.repeat_letter import compute_reward, make_dataset, make_rows
from verl.utils.dataset import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return load_tokenizer(tiny_model_path)


def test_generator_writes_deterministic_train_and_val(tmp_path):
    train, val = make_dataset(tmp_path / "a", train_size=20, val_size=5, seed=3)
    train_b, _ = make_dataset(tmp_path / "b", train_size=20, val_size=5, seed=3)
    rows = pq.read_table(train).to_pylist()
    assert rows == pq.read_table(train_b).to_pylist()
    assert len(rows) == 20 and pq.read_table(val).num_rows == 5
    assert set(rows[0]) == {"prompt", "target", "data_source", "extra_info"}
    for row in rows:
        assert row["prompt"][0]["role"] == "user"
        assert row["target"] in row["prompt"][0]["content"]
    assert make_rows(5, seed=1) != make_rows(5, seed=2)


def _batch(tokenizer, texts, targets, response_length=8, eos_after=None):
    rows, masks = [], []
    for i, text in enumerate(texts):
        ids = tokenizer.encode(text)[:response_length]
        if eos_after is not None and eos_after[i] is not None:
            ids = ids[:eos_after[i]] + [tokenizer.eos_token_id]
        mask = [1] * len(ids) + [0] * (response_length - len(ids))
        rows.append(ids + [tokenizer.pad_token_id] * (response_length - len(ids)))
        masks.append(mask)
    return DataProto.from_dict(
        tensors={"responses": torch.tensor(rows), "response_mask": torch.tensor(masks)},
        non_tensors={"target": np.array(targets, dtype=object)},
    )


def test_reward_values_are_hand_checkable(tokenizer):
    data = _batch(tokenizer, ["c c c c", "d d d d", "123, 456.", "c d c d", "cccc"], ["c", "c", "c", "c", "c"])
    reward, metrics = compute_reward(data, tokenizer, num_tokens=4, letter_credit=0.5)
    scores = reward.sum(dim=-1)
    assert reward.dtype == torch.float32 and reward.shape == (5, 8)
    assert scores[0].item() == pytest.approx(1.0)
    assert scores[1].item() == pytest.approx(0.5)
    assert scores[2].item() == pytest.approx(0.0)
    assert scores[3].item() == pytest.approx(0.75)
    assert metrics["repeat_letter/solved"] == pytest.approx(0.2)
    assert 0.0 <= metrics["repeat_letter/letter_frac"] <= 1.0


def test_reward_sits_on_last_loss_token_and_missing_slots_score_zero(tokenizer):
    data = _batch(tokenizer, ["c c c c", "c c c c"], ["c", "c"], eos_after=[2, None])
    reward, _ = compute_reward(data, tokenizer, num_tokens=4)
    mask = data.batch["response_mask"]
    for row in range(2):
        last = int(mask[row].nonzero().max())
        assert reward[row].nonzero().flatten().tolist() == [last]
    # row 0: two 'c' tokens then eos -> 2 of 4 slots
    assert reward[0].sum().item() == pytest.approx(0.5)
    assert reward[1].sum().item() == pytest.approx(1.0)


def test_reward_kwargs_are_validated(tokenizer):
    data = _batch(tokenizer, ["c"], ["c"])
    with pytest.raises(ValueError, match="num_tokens must be positive"):
        compute_reward(data, tokenizer, num_tokens=0)
    with pytest.raises(TypeError):
        compute_reward(data, tokenizer, unknown=1)
    with pytest.raises(KeyError, match="target"):
        compute_reward(data, tokenizer, target_key="missing")
