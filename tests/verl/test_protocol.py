"""Tests of verl.protocol: DataProto row operations keep tensors, non-tensors and meta_info consistent."""

import pickle

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from verl.protocol import (
    DataProto,
    DataProtoItem,
    collate_fn,
    pad_dataproto_to_divisor,
    union_tensor_dict,
    unpad_dataproto,
)


def make_data(n: int = 6) -> DataProto:
    """A batch whose row i holds value i in every field, so row movements can be checked field by field."""
    uid = np.array([f"u{i}" for i in range(n)], dtype=object)
    msgs = np.empty(n, dtype=object)
    for i in range(n):
        msgs[i] = [{"role": "user", "content": str(i)}]
    return DataProto.from_dict(
        tensors={"x": torch.arange(n).unsqueeze(1).repeat(1, 3), "y": torch.arange(n, dtype=torch.float32)},
        non_tensors={"uid": uid, "messages": msgs},
        meta_info={"temperature": 1.0},
    )


def assert_rows(data: DataProto, rows: list[int]) -> None:
    """Check that every field of `data` holds rows `rows` of make_data()."""
    assert len(data) == len(rows)
    assert data.batch["x"][:, 0].tolist() == rows
    assert data.batch["y"].tolist() == [float(r) for r in rows]
    assert list(data.non_tensor_batch["uid"]) == [f"u{r}" for r in rows]
    assert [m[0]["content"] for m in data.non_tensor_batch["messages"]] == [str(r) for r in rows]


def test_from_dict_and_len():
    data = make_data(4)
    assert len(data) == 4
    assert data.batch.batch_size == torch.Size([4])
    assert data.meta_info == {"temperature": 1.0}
    assert_rows(data, [0, 1, 2, 3])


def test_from_dict_list_non_tensor_becomes_object_rows():
    data = DataProto.from_dict(tensors={"a": torch.zeros(2, 1)}, non_tensors={"m": [[1, 2], [3, 4]]})
    assert data.non_tensor_batch["m"].shape == (2,)
    assert data.non_tensor_batch["m"][1] == [3, 4]


def test_from_dict_rejects_mismatched_tensor_batch():
    with pytest.raises(ValueError, match="'b'.*batch shape"):
        DataProto.from_dict(tensors={"a": torch.zeros(3, 2), "b": torch.zeros(4, 2)})


def test_from_dict_needs_one_batch_dim_as_in_verl():
    # veRL's DataProto has exactly one batch dim; a second one is a contract error (ValueError and AssertionError)
    for error in (ValueError, AssertionError):
        with pytest.raises(error, match="exactly one batch dim"):
            DataProto.from_dict(tensors={"a": torch.zeros(2, 3, 4)}, num_batch_dims=2)
    with pytest.raises(ValueError, match="exactly one batch dim"):
        DataProto(batch=TensorDict({"a": torch.zeros(2, 3)}, batch_size=[2, 3]))


def test_from_single_dict_splits_types():
    data = DataProto.from_single_dict({"a": torch.ones(2, 2), "u": np.array(["p", "q"], dtype=object)}, {"k": 1})
    assert list(data.batch.keys()) == ["a"]
    assert list(data.non_tensor_batch) == ["u"]
    assert data.meta_info == {"k": 1}
    with pytest.raises(TypeError, match="'bad'"):
        DataProto.from_single_dict({"bad": [1, 2]})


def test_consistency_errors_name_key_and_lengths():
    batch = TensorDict({"a": torch.zeros(3)}, batch_size=[3])
    with pytest.raises(ValueError, match=r"'uid'.*length 2.*batch size is 3"):
        DataProto(batch=batch, non_tensor_batch={"uid": np.array(["a", "b"], dtype=object)})
    with pytest.raises(TypeError, match="'uid'.*np.ndarray"):
        DataProto(batch=batch, non_tensor_batch={"uid": ["a", "b", "c"]})


def test_non_tensor_only_dataproto():
    data = DataProto.from_dict(non_tensors={"u": np.array([1, 2, 3])})
    assert data.batch is None
    assert len(data) == 3
    assert data[[2, 0]].non_tensor_batch["u"].tolist() == [3, 1]


def test_getitem_int_slice_list_tensor_mask():
    data = make_data(6)
    item = data[-1]
    assert isinstance(item, DataProtoItem)
    assert item.batch["y"].item() == 5.0 and item.non_tensor_batch["uid"] == "u5"
    assert_rows(data[1:5:2], [1, 3])
    assert_rows(data[[4, 0, 4]], [4, 0, 4])
    assert_rows(data[np.array([2, 1])], [2, 1])
    assert_rows(data[torch.tensor([5, -6])], [5, 0])
    mask = torch.tensor([True, False, False, True, False, True])
    assert_rows(data[mask], [0, 3, 5])
    with pytest.raises(IndexError, match="out of range"):
        data[6]
    with pytest.raises(IndexError, match="out of range"):
        data[[0, 7]]
    with pytest.raises(IndexError, match="boolean mask has length 2"):
        data[np.array([True, False])]


def test_select_and_deepcopy():
    data = make_data(3)
    sub = data.select(batch_keys=["x"], non_tensor_batch_keys=["uid"], meta_info_keys=[])
    assert list(sub.batch.keys()) == ["x"] and list(sub.non_tensor_batch) == ["uid"] and sub.meta_info == {}
    deep = data.select(deepcopy=True)
    deep.batch["x"][0, 0] = 100
    deep.non_tensor_batch["messages"][0][0]["content"] = "changed"
    assert data.batch["x"][0, 0].item() == 0
    assert data.non_tensor_batch["messages"][0][0]["content"] == "0"
    with pytest.raises(KeyError, match="'nope'"):
        data.select(batch_keys=["nope"])
    with pytest.raises(KeyError, match="'nope'"):
        data.select(non_tensor_batch_keys=["nope"])


def test_pop_removes_keys():
    data = make_data(3)
    popped = data.pop(batch_keys=["y"], non_tensor_batch_keys=["uid"], meta_info_keys=["temperature"])
    assert list(popped.batch.keys()) == ["y"] and popped.batch["y"].tolist() == [0.0, 1.0, 2.0]
    assert list(popped.non_tensor_batch) == ["uid"] and popped.meta_info == {"temperature": 1.0}
    assert list(data.batch.keys()) == ["x"]
    assert list(data.non_tensor_batch) == ["messages"] and data.meta_info == {}
    assert len(popped) == len(data) == 3


def test_rename():
    data = make_data(2).rename("y", "z")
    assert set(data.batch.keys()) == {"x", "z"}
    data.rename(["x", "z"], ["a", "b"])
    assert set(data.batch.keys()) == {"a", "b"}
    with pytest.raises(KeyError, match="'missing'"):
        data.rename("missing", "c")


def test_union_merges_and_checks_conflicts():
    data = make_data(3)
    other = DataProto.from_dict(
        tensors={"x": data.batch["x"].clone(), "w": torch.ones(3)},
        non_tensors={"uid": data.non_tensor_batch["uid"].copy(), "score": np.array([0.1, 0.2, 0.3])},
        meta_info={"temperature": 1.0, "step": 7},
    )
    merged = data.union(other)
    assert merged is data
    assert set(data.batch.keys()) == {"x", "y", "w"}
    assert set(data.non_tensor_batch) == {"uid", "messages", "score"}
    assert data.meta_info == {"temperature": 1.0, "step": 7}
    bad = DataProto.from_dict(tensors={"x": torch.zeros(3, 3, dtype=torch.int64)})
    with pytest.raises(ValueError, match="'x'"):
        make_data(3).union(bad)
    bad_nt = DataProto.from_dict(non_tensors={"uid": np.array(["a", "b", "c"], dtype=object)})
    with pytest.raises(ValueError, match="'uid'"):
        make_data(3).union(bad_nt)
    with pytest.raises(ValueError, match="'temperature'"):
        make_data(3).union(DataProto(meta_info={"temperature": 0.5}))
    with pytest.raises(ValueError, match="batch sizes differ"):
        make_data(3).union(make_data(4))


def test_union_tensor_dict_helper():
    a = TensorDict({"a": torch.ones(2)}, batch_size=[2])
    b = TensorDict({"b": torch.zeros(2), "a": torch.ones(2)}, batch_size=[2])
    assert set(union_tensor_dict(a, b).keys()) == {"a", "b"}
    with pytest.raises(ValueError, match="batch sizes differ"):
        union_tensor_dict(a, TensorDict({"c": torch.ones(3)}, batch_size=[3]))


def test_chunk_split_and_errors():
    data = make_data(6)
    chunks = data.chunk(3)
    assert [len(c) for c in chunks] == [2, 2, 2]
    assert_rows(chunks[2], [4, 5])
    assert all(c.meta_info == {"temperature": 1.0} for c in chunks)
    with pytest.raises(ValueError, match="batch size 6 is not divisible by chunks=4"):
        data.chunk(4)
    parts = data.split(4)
    assert [len(p) for p in parts] == [4, 2]
    assert_rows(parts[1], [4, 5])


def test_concat_roundtrip_and_meta_merge():
    data = make_data(6)
    parts = data.chunk(3)
    for i, part in enumerate(parts):
        part.meta_info["metrics"] = {"loss": [float(i), float(i) + 0.5], "lr": 0.1}
    joined = DataProto.concat(parts)
    assert_rows(joined, list(range(6)))
    assert joined.meta_info["temperature"] == 1.0
    assert joined.meta_info["metrics"] == {"loss": [0.0, 0.5, 1.0, 1.5, 2.0, 2.5], "lr": [0.1, 0.1, 0.1]}
    parts[1].meta_info["temperature"] = 0.7
    with pytest.raises(ValueError, match="'temperature'"):
        DataProto.concat(parts)


def test_concat_never_drops_keys():
    a, b = make_data(2), make_data(2)
    b.non_tensor_batch.pop("messages")
    with pytest.raises(ValueError, match="part 1 has non_tensor_batch keys"):
        DataProto.concat([a, b])
    c = make_data(2)
    c.batch.pop("y")
    with pytest.raises(ValueError, match="part 1 has batch keys"):
        DataProto.concat([make_data(2), c])


def test_concat_gathers_list_of_metric_dicts():
    a, b = make_data(2), make_data(2)
    a.meta_info["metrics"] = [{"loss": 1.0}, {"loss": 2.0}]
    b.meta_info["metrics"] = {"loss": 3.0, "kl": 0.5}
    assert DataProto.concat([a, b]).meta_info["metrics"] == {"loss": [1.0, 2.0, 3.0], "kl": [0.5]}


def test_select_and_union_do_not_alias_containers():
    data = make_data(3)
    view = data.select()
    view.union(DataProto.from_dict(tensors={"extra": torch.ones(3)}))
    assert "extra" not in data.batch.keys()
    empty = DataProto()
    extra = DataProto.from_dict(tensors={"z": torch.zeros(3)})
    empty.union(extra).union(DataProto.from_dict(tensors={"w": torch.zeros(3)}))
    assert list(extra.batch.keys()) == ["z"] and set(empty.batch.keys()) == {"z", "w"}


def test_reorder_in_place_moves_everything():
    data = make_data(5)
    data.reorder(torch.tensor([4, 2, 0, 1, 3]))
    assert_rows(data, [4, 2, 0, 1, 3])
    with pytest.raises(ValueError, match="permutation"):
        data.reorder([0, 0, 1, 2, 3])


def test_repeat_interleave_and_tile():
    data = make_data(3)
    assert_rows(data.repeat(2, interleave=True), [0, 0, 1, 1, 2, 2])
    assert_rows(data.repeat(2, interleave=False), [0, 1, 2, 0, 1, 2])
    assert data.repeat(3).meta_info == {"temperature": 1.0}


def test_pad_and_unpad():
    data = make_data(5)
    padded, pad_size = pad_dataproto_to_divisor(data, 4)
    assert pad_size == 3
    assert_rows(padded, [0, 1, 2, 3, 4, 0, 1, 2])
    assert_rows(unpad_dataproto(padded, pad_size), [0, 1, 2, 3, 4])
    small, pad_small = pad_dataproto_to_divisor(make_data(2), 7)
    assert pad_small == 5
    assert_rows(small, [0, 1, 0, 1, 0, 1, 0])
    same, zero = pad_dataproto_to_divisor(data, 5)
    assert zero == 0 and same is data


def test_make_iterator_covers_every_row_each_epoch():
    data = make_data(6)
    batches = list(data.make_iterator(mini_batch_size=2, epochs=2, seed=3, dataloader_kwargs={"shuffle": True}))
    assert len(batches) == 6
    for epoch in range(2):
        seen = sorted(r for b in batches[epoch * 3 : epoch * 3 + 3] for r in b.batch["x"][:, 0].tolist())
        assert seen == list(range(6))
    for b in batches:
        rows = b.batch["x"][:, 0].tolist()
        assert list(b.non_tensor_batch["uid"]) == [f"u{r}" for r in rows]
        assert b.meta_info == {"temperature": 1.0}
    again = list(data.make_iterator(2, 2, seed=3, dataloader_kwargs={"shuffle": True}))
    assert [b.batch["x"][:, 0].tolist() for b in again] == [b.batch["x"][:, 0].tolist() for b in batches]
    ordered = list(data.make_iterator(3, 1))
    assert_rows(ordered[0], [0, 1, 2])
    with pytest.raises(ValueError, match="not divisible by mini_batch_size=4"):
        data.make_iterator(4, 1)


def test_save_load_and_pickle(tmp_path):
    data = make_data(3)
    path = tmp_path / "d.pkl"
    data.save_to_disk(str(path))
    loaded = DataProto.load_from_disk(str(path))
    assert_rows(loaded, [0, 1, 2])
    assert loaded.meta_info == data.meta_info
    assert_rows(pickle.loads(pickle.dumps(data)), [0, 1, 2])


def test_collate_fn_from_dicts_and_items():
    rows = [{"ids": torch.tensor([i, i]), "uid": f"u{i}", "profile": {"trust": i}} for i in range(3)]
    data = collate_fn(rows)
    assert data.batch["ids"].shape == (3, 2)
    assert list(data.non_tensor_batch["uid"]) == ["u0", "u1", "u2"]
    assert data.non_tensor_batch["profile"][2] == {"trust": 2}
    source = make_data(4)
    rebuilt = collate_fn([source[i] for i in [3, 1]])
    assert_rows(rebuilt, [3, 1])
    with pytest.raises(ValueError, match="'uid' is present in 1 of 2 rows"):
        collate_fn([{"uid": "a"}, {"other": "b"}])


def test_to_device_and_info():
    data = make_data(2).to("cpu")
    assert data.batch.device == torch.device("cpu")
    info = data.get_data_info()
    assert "2 rows" in info and "'x'" in info and "'uid'" in info
    assert repr(data) == (
        "DataProto(rows=2, batch=['x', 'y'], non_tensor_batch=['uid', 'messages'], meta_info=['temperature'])"
    )
    assert data != make_data(2) and data == data
