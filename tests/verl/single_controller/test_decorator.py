"""Unit tests of `@register` and the dispatch/collect functions (pure Python, no workers)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl.protocol import DataProto
from verl.single_controller.base.decorator import (
    Dispatch,
    DP_PAD_ROWS_KEY,
    DispatchPlan,
    Execute,
    RegisterSpec,
    collect_all,
    collect_dp_compute_proto,
    collect_rank_zero,
    dispatch_all_to_all,
    dispatch_dp_compute,
    dispatch_dp_compute_metric,
    dispatch_dp_compute_proto,
    dispatch_one_to_all,
    dispatch_rank_zero,
    get_dispatch_fns,
    get_register_spec,
    register,
)


def make_batch(n: int) -> DataProto:
    """A batch whose row i holds the value i in a tensor, a non-tensor array and a string uid."""
    return DataProto.from_dict(
        tensors={"x": torch.arange(n, dtype=torch.float32).unsqueeze(1).repeat(1, 3)},
        non_tensors={"uid": np.array([f"u{i}" for i in range(n)], dtype=object)},
        meta_info={"temperature": 0.7},
    )


def double_rows(data: DataProto) -> DataProto:
    """A per-rank computation: output row = 2 * input row, uid carried through, rank-local metrics."""
    return DataProto.from_dict(
        tensors={"y": data.batch["x"] * 2},
        non_tensors={"uid": data.non_tensor_batch["uid"]},
        meta_info={"metrics": {"rows": len(data)}},
    )


def test_register_attaches_spec_and_keeps_function():
    def method(self, x):
        return x + 1

    decorated = register(Dispatch.DP_COMPUTE_PROTO, Execute.ALL, blocking=False)(method)
    assert decorated is method
    assert decorated(None, 1) == 2
    assert get_register_spec(decorated) == RegisterSpec(Dispatch.DP_COMPUTE_PROTO, Execute.ALL, False)
    assert get_register_spec(lambda: None) is None


def test_register_defaults_and_rank_zero_only():
    spec = get_register_spec(register()(lambda self: None))
    assert spec == RegisterSpec(Dispatch.ALL_TO_ALL, Execute.ALL, True)
    assert not spec.rank_zero_only
    assert get_register_spec(register(Dispatch.RANK_ZERO)(lambda self: None)).rank_zero_only
    assert get_register_spec(register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)(lambda self: None)).rank_zero_only


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dispatch_mode": "one_to_all"}, "dispatch_mode must be a Dispatch member"),
        ({"execute_mode": 0}, "execute_mode must be an Execute member"),
        ({"blocking": "yes"}, "blocking must be a bool"),
    ],
)
def test_register_rejects_bad_arguments(kwargs, message):
    with pytest.raises(TypeError, match=message):
        register(**kwargs)


def test_every_dispatch_mode_has_functions():
    for mode in Dispatch:
        dispatch_fn, collect_fn = get_dispatch_fns(mode)
        assert callable(dispatch_fn) and callable(collect_fn)


def test_one_to_all_and_rank_zero():
    plan = dispatch_one_to_all(3, (1, "a"), {"k": [5]})
    assert plan.calls == [((1, "a"), {"k": [5]})] * 3
    assert collect_all(["r0", "r1", "r2"], plan) == ["r0", "r1", "r2"]

    plan = dispatch_rank_zero(3, (1,), {"k": 2})
    assert plan.calls == [((1,), {"k": 2})]
    assert collect_rank_zero(["only"], plan) == "only"


@pytest.mark.parametrize("dispatch_fn", [dispatch_all_to_all, dispatch_dp_compute])
def test_all_to_all_gives_each_rank_its_item(dispatch_fn):
    plan = dispatch_fn(2, ([10, 11], ("a", "b")), {"k": [0.5, 1.5]})
    assert plan.calls == [((10, "a"), {"k": 0.5}), ((11, "b"), {"k": 1.5})]


def test_all_to_all_rejects_wrong_lengths_and_scalars():
    with pytest.raises(ValueError, match=r"ALL_TO_ALL: positional argument 1 must be a list of world_size=2 items.*length 3"):
        dispatch_all_to_all(2, ([1, 2], [1, 2, 3]), {})
    with pytest.raises(ValueError, match=r"DP_COMPUTE: keyword argument 'k' must be a list of world_size=2"):
        dispatch_dp_compute(2, (), {"k": 7})
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        dispatch_all_to_all(0, (), {})


@pytest.mark.parametrize("world_size, n", [(2, 5), (2, 4), (3, 7), (4, 1), (1, 3)])
def test_dp_compute_proto_pads_chunks_and_unpads_in_order(world_size, n):
    data = make_batch(n)
    plan = dispatch_dp_compute_proto(world_size, (data,), {"scale": 2})
    assert len(plan.calls) == world_size
    assert plan.pad_size == (-n) % world_size
    assert plan.padded_rows == n + plan.pad_size
    chunk_sizes = {len(args[0]) for args, _ in plan.calls}
    assert chunk_sizes == {(n + plan.pad_size) // world_size}
    assert all(kwargs == {"scale": 2} for _, kwargs in plan.calls)
    assert all(args[0].meta_info["temperature"] == 0.7 for args, _ in plan.calls)

    outputs = [double_rows(args[0]) for args, _ in plan.calls]
    result = collect_dp_compute_proto(outputs, plan)
    assert len(result) == n
    torch.testing.assert_close(result.batch["y"], make_batch(n).batch["x"] * 2)
    assert list(result.non_tensor_batch["uid"]) == [f"u{i}" for i in range(n)]
    assert result.meta_info["metrics"]["rows"] == [len(args[0]) for args, _ in plan.calls]


@pytest.mark.parametrize(
    "world_size, n, expected", [(2, 5, [0, 1]), (4, 1, [0, 1, 1, 1]), (3, 7, [0, 0, 2]), (2, 4, [0, 0])]
)
def test_dp_compute_proto_marks_padding_rows_per_chunk(world_size, n, expected):
    """Each chunk says how many of its trailing rows are padding, so an update can give them no loss."""
    plan = dispatch_dp_compute_proto(world_size, (make_batch(n),), {})
    chunks = [args[0] for args, _ in plan.calls]
    assert [chunk.meta_info.get(DP_PAD_ROWS_KEY, 0) for chunk in chunks] == expected
    assert sum(expected) == plan.pad_size
    # a worker echoing its chunk's meta_info does not leak the marker (or a conflict) into the result
    result = collect_dp_compute_proto(chunks, plan)
    assert DP_PAD_ROWS_KEY not in result.meta_info and len(result) == n
    # a stale marker on the input is not forwarded to ranks without padding
    stale = make_batch(4)
    stale.meta_info[DP_PAD_ROWS_KEY] = 3
    assert all(DP_PAD_ROWS_KEY not in args[0].meta_info for args, _ in dispatch_dp_compute_proto(2, (stale,), {}).calls)


def test_dp_compute_proto_chunks_keyword_dataproto_and_checks_sizes():
    plan = dispatch_dp_compute_proto(2, (), {"data": make_batch(4), "other": make_batch(4)})
    assert [len(kwargs["data"]) for _, kwargs in plan.calls] == [2, 2]
    assert [list(kwargs["other"].non_tensor_batch["uid"]) for _, kwargs in plan.calls] == [["u0", "u1"], ["u2", "u3"]]
    with pytest.raises(ValueError, match=r"same batch size; positional argument 0 has 4 rows, keyword argument 'b' has 3"):
        dispatch_dp_compute_proto(2, (make_batch(4),), {"b": make_batch(3)})
    with pytest.raises(TypeError, match="expects at least one DataProto argument"):
        dispatch_dp_compute_proto(2, ([1, 2],), {})
    with pytest.raises(ValueError, match="empty DataProto"):
        dispatch_dp_compute_proto(2, (DataProto(),), {})


def test_dp_compute_proto_collect_errors_are_clear():
    plan = dispatch_dp_compute_proto(2, (make_batch(3),), {})
    with pytest.raises(TypeError, match="rank 1 returned a dict"):
        collect_dp_compute_proto([make_batch(2), {"y": 1}], plan)
    with pytest.raises(ValueError, match=r"returned 2 rows for 4 input rows \(of which 1 are padding\)"):
        collect_dp_compute_proto([make_batch(1), make_batch(1)], plan)


def test_dp_compute_proto_meta_only_results_merge_metrics():
    plan = dispatch_dp_compute_proto(2, (make_batch(3),), {})
    outputs = [DataProto(meta_info={"metrics": {"loss": [0.5, 0.25]}}), DataProto(meta_info={"metrics": {"loss": [1.0]}})]
    result = collect_dp_compute_proto(outputs, plan)
    assert len(result) == 0
    assert result.meta_info["metrics"] == {"loss": [0.5, 0.25, 1.0]}


def test_dp_compute_metric_splits_without_padding():
    plan = dispatch_dp_compute_metric(2, (make_batch(4),), {})
    assert plan.pad_size == 0
    assert [list(args[0].non_tensor_batch["uid"]) for args, _ in plan.calls] == [["u0", "u1"], ["u2", "u3"]]
    assert collect_all([{"m": 1}, {"m": 2}], plan) == [{"m": 1}, {"m": 2}]
    with pytest.raises(ValueError, match=r"DP_COMPUTE_METRIC: positional argument 0 has 5 rows, not divisible by world_size=2"):
        dispatch_dp_compute_metric(2, (make_batch(5),), {})


def test_collect_rank_zero_without_output_raises():
    with pytest.raises(ValueError, match="no result to collect"):
        collect_rank_zero([], DispatchPlan(calls=[]))
