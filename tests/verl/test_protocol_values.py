"""Tests of verl.protocol.values and verl.protocol.rows: value comparison, meta_info merging, row-index validation."""

import numpy as np
import pytest
import torch

from verl import protocol
from verl.protocol import values
from verl.protocol.rows import as_index_array
from verl.protocol.values import merge_meta_info, to_row_array, values_equal


def test_values_equal_handles_nan_containers_and_type_mismatches():
    nan = float("nan")
    assert values_equal(torch.tensor([1.0, nan]), torch.tensor([1.0, nan]))
    assert not values_equal(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))
    assert values_equal(np.array([nan, 2.0]), np.array([nan, 2.0]))
    assert values_equal({"a": [1, (2, nan)]}, {"a": [1, (2, nan)]})
    assert not values_equal([1, 2], (1, 2))
    assert not values_equal(torch.tensor([1]), np.array([1]))
    assert not values_equal(torch.zeros(2), torch.zeros(3))


def test_merge_meta_info_names_the_conflicting_key():
    target = {"temperature": 1.0}
    assert merge_meta_info(target, {"temperature": 1.0, "n": 2}, "here") == {"temperature": 1.0, "n": 2}
    with pytest.raises(ValueError, match=r"here: Conflicting values for meta_info key 'temperature': 1.0 != 0.5"):
        merge_meta_info(target, {"temperature": 0.5}, "here")


def test_as_index_array_accepts_ints_negatives_and_masks():
    assert as_index_array([0, -1, 2], 4).tolist() == [0, 3, 2]
    assert as_index_array(torch.tensor([True, False, True, False]), 4).tolist() == [0, 2]
    assert as_index_array([], 4).dtype == np.int64
    with pytest.raises(IndexError, match="out of range for a batch of 4 rows"):
        as_index_array([4], 4)
    with pytest.raises(IndexError, match="boolean mask has length 3"):
        as_index_array(np.array([True, False, True]), 4)
    with pytest.raises(IndexError, match="integers or a boolean mask"):
        as_index_array([0.5], 4)


def test_to_row_array_keeps_one_object_per_row():
    rows = to_row_array([[1, 2], [3]], "messages")
    assert rows.dtype == object and rows.shape == (2,) and rows[0] == [1, 2]
    with pytest.raises(TypeError, match=r"non_tensor_batch\['x'\]"):
        to_row_array("abc", "x")


def test_verl_protocol_re_exports_union_tensor_dict():
    assert protocol.union_tensor_dict is values.union_tensor_dict
