"""veRL-style DataProto manipulation and dispatch-mode registration on SEAD's engine (expected values by hand)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl import DataProto
from verl.errors import ContractError
from verl.protocol import (
    DataProtoConfig,
    deserialize_tensordict,
    serialize_tensordict,
    union_numpy_dict,
)
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import (
    Dispatch,
    get_predefined_dispatch_fn,
    register,
    register_dispatch_mode,
    update_dispatch_mode,
)
from verl.single_controller.base.worker_group import WorkerGroup


def rows(n: int) -> DataProto:
    return DataProto.from_dict(tensors={"x": torch.arange(n)}, non_tensors={"u": [f"r{i}" for i in range(n)]},
                               meta_info={"t": 1})


def test_contract_errors_are_value_and_assertion_errors():
    with pytest.raises(AssertionError, match="not divisible"):
        rows(5).chunk(2)
    with pytest.raises(ValueError, match="Conflicting values for meta_info key 't'"):
        DataProto.concat([rows(1), DataProto.from_dict(tensors={"x": torch.zeros(1)}, non_tensors={"u": ["z"]},
                                                       meta_info={"t": 2})])
    assert issubclass(ContractError, ValueError) and issubclass(ContractError, AssertionError)


def test_sample_level_repeat_and_auto_padding_chunk():
    repeated = rows(3).sample_level_repeat([2, 0, 3])
    assert repeated.batch["x"].tolist() == [0, 0, 2, 2, 2]
    assert repeated.non_tensor_batch["u"].tolist() == ["r0", "r0", "r2", "r2", "r2"]
    padded = DataProto.from_dict(tensors={"x": torch.arange(5)}, auto_padding=True)
    assert [part.batch["x"].tolist() for part in padded.chunk(2)] == [[0, 1, 2], [3, 4]]
    data = rows(5)
    data.padding(3)
    assert data.batch["x"].tolist() == [0, 1, 2, 3, 4, 4, 4, 4] and data.non_tensor_batch["u"][-1] == "r4"
    DataProtoConfig.auto_padding = True
    try:
        assert len(rows(5).chunk(3)) == 3
    finally:
        DataProtoConfig.auto_padding = False


def test_tensordict_round_trip_keeps_nested_rows_and_meta_info():
    data = DataProto.from_dict(tensors={"x": torch.arange(3)},
                               non_tensors={"turns": [[], [0.5, 0.8], [{"role": "user"}]]}, meta_info={"step": 4})
    td = data.to_tensordict()
    back = DataProto.from_tensordict(td)
    assert back.batch["x"].tolist() == [0, 1, 2] and back.meta_info == {"step": 4}
    assert [list(v) for v in back.non_tensor_batch["turns"]] == [[], [0.5, 0.8], [{"role": "user"}]]


def test_serialized_tensordict_round_trip_bitwise():
    from tensordict import TensorDict

    td = TensorDict({"bf16": torch.randn(2, 3).bfloat16(), "b": torch.tensor([[True], [False]]),
                     "nested": torch.nested.as_nested_tensor([torch.ones(2), torch.zeros(3)], layout=torch.jagged)}, batch_size=[2])
    back = deserialize_tensordict(serialize_tensordict(td))
    assert torch.equal(back["bf16"], td["bf16"]) and back["bf16"].dtype == torch.bfloat16
    assert torch.equal(back["b"], td["b"])
    assert [t.tolist() for t in back["nested"].unbind()] == [[1.0, 1.0], [0.0, 0.0, 0.0]]


def test_union_numpy_dict_deep_equality_with_cycles():
    a, b = np.array([None], dtype=object), np.array([None], dtype=object)
    a[0], b[0] = a, b
    assert union_numpy_dict({"c": a}, {"c": b, "d": np.ones(1)})["d"].tolist() == [1.0]
    with pytest.raises(AssertionError, match="`c` in tensor_dict1 and tensor_dict2 are not the same object"):
        union_numpy_dict({"c": a}, {"c": np.array([None], dtype=object)})


class LocalGroup(WorkerGroup):
    """An in-process worker group: rank r's method runs on workers[r] directly (no Ray)."""

    def __init__(self, workers: list[Worker]) -> None:
        super().__init__("local")
        self.workers = workers
        self._bind_worker_methods(type(workers[0]))

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def _check_method(self, method: str) -> None:
        getattr(self.workers[0], method)

    def _launch(self, method, calls):
        return [getattr(w, method)(*args, **kwargs) for w, (args, kwargs) in zip(self.workers, calls)]

    def _wait(self, method, handles):
        return list(handles)


def test_user_registered_dispatch_mode_follows_verl_convention():
    def split_by_rank(worker_group, values):
        return ([values[r::worker_group.world_size] for r in range(worker_group.world_size)],), {}

    def total(worker_group, outputs):
        return sum(outputs)

    register_dispatch_mode("COMPAT_STRIDED", split_by_rank, total)
    try:
        assert get_predefined_dispatch_fn(Dispatch.COMPAT_STRIDED) == {"dispatch_fn": split_by_rank,
                                                                        "collect_fn": total}

        class Summer(Worker):
            @register(dispatch_mode=Dispatch.COMPAT_STRIDED)
            def add(self, values):
                return sum(values) * (self.rank + 1)

        workers = [Summer(), Summer()]
        workers[1]._rank = 1
        group = LocalGroup(workers)
        # rank 0 gets [1, 3, 5] (x1), rank 1 gets [2, 4] (x2)
        assert group.add([1, 2, 3, 4, 5]) == 9 + 12
    finally:
        Dispatch.remove("COMPAT_STRIDED")


def test_update_dispatch_mode_replaces_builtin_functions():
    original = get_predefined_dispatch_fn(Dispatch.ONE_TO_ALL)
    try:
        update_dispatch_mode(Dispatch.ONE_TO_ALL, lambda wg, *a, **k: (a, k), lambda wg, outs: outs[::-1])
        assert get_predefined_dispatch_fn(Dispatch.ONE_TO_ALL)["collect_fn"](None, [1, 2]) == [2, 1]
    finally:
        from verl.single_controller.base import decorator

        decorator.DISPATCH_MODE_FN_REGISTRY[Dispatch.ONE_TO_ALL] = {**original, "plan_style": True}


def test_worker_dispatch_collect_info_and_nd_dispatch():
    from verl.single_controller.base.decorator import make_nd_compute_dataproto_dispatch_fn

    class Doubler(Worker):
        @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("train"), blocking=False)
        def double(self, data: DataProto) -> DataProto:
            return DataProto.from_dict(tensors={"y": data.batch["x"] * 2 + 100 * self.rank})

    workers = [Doubler() for _ in range(4)]
    for rank, worker in enumerate(workers):  # a TP-2 layout: ranks (0,1) are dp 0, (2,3) dp 1; first of each kept
        worker._rank = rank
        worker._register_dispatch_collect_info("train", dp_rank=rank // 2, is_collect=rank % 2 == 0)
    with pytest.raises(AssertionError, match="already registered"):
        workers[0]._register_dispatch_collect_info("train", dp_rank=0, is_collect=True)
    copy = Doubler()
    copy.set_dispatch_collect(mesh_name="ref", **workers[3].get_dispatch_collect())
    assert copy._query_dispatch_info("ref") == 1 and copy._query_collect_info("ref") is False
    out = LocalGroup(workers).double(rows(4)).get()
    assert out.batch["y"].tolist() == [0, 2, 204, 206]
