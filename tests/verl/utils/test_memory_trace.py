"""MemoryTrace: live storages by category, phase peaks replayed from the allocations, resize_ (FSDP2's way of
freeing), offloaded storages, DTensor shards and the collectives of a fake process group, against hand-counted
bytes."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import Shard, distribute_tensor

from verl.trainer.trace_models import fake_world
from verl.utils.memory_trace import (ACTIVATIONS, GATHERED, GRADIENTS, LOGITS, OPTIMIZER, WEIGHTS, MemoryTrace,
                                     dtype_name, tensor_storages)

pytestmark = [pytest.mark.oldest,  # also run under the lowest declared transformers (.venv-vllm)
              pytest.mark.usefixtures("no_process_group")]

MB = 2**20


@pytest.mark.parametrize("fake", [False, True])
def test_a_phase_peak_is_the_largest_sum_of_live_storages_by_category(fake):
    with FakeTensorMode() if fake else torch.no_grad():
        weight = torch.empty(MB // 4)  # 1 MiB of fp32
        trace = MemoryTrace(logits_width=1000)
        trace.track([weight], WEIGHTS)
        with trace, trace.phase("pass"):
            a = torch.ones(2 * MB // 2, dtype=torch.bfloat16)  # 2 MiB
            b = a.view(2, -1) * 2  # 2 MiB more; the view adds nothing
            logits = torch.zeros(MB // 4000, 1000)  # last dimension = the vocabulary: logits (1 MiB rounded down)
            del a
            c = torch.empty(3 * MB // 4)  # 3 MiB while b (2) and the logits live: the peak
            del b, c, logits
            d = torch.empty(MB // 4)  # after the peak: does not change it
            del d
    phase = trace["pass"]
    logits_bytes = (MB // 4000) * 1000 * 4
    assert phase.peak[WEIGHTS] == MB
    assert phase.peak[ACTIVATIONS] == 2 * MB + 3 * MB
    assert phase.peak[LOGITS] == logits_bytes
    assert phase.total == MB + 5 * MB + logits_bytes
    assert phase.dtypes[ACTIVATIONS] == {"bf16": 2 * MB, "fp32": 3 * MB}
    assert trace.live_bytes() == MB  # everything the phase allocated is freed


def test_categorize_counts_a_storage_from_its_allocation_and_offloaded_ones_are_left_out():
    trace = MemoryTrace()
    with FakeTensorMode():
        weight, state = torch.empty(MB // 4), torch.empty(2 * MB // 4)
        trace.track([weight], WEIGHTS)
        trace.track([state], OPTIMIZER)
        trace.set_on_device([state], False)  # offloaded: not on the GPU in the next phase
        with trace, trace.phase("backward"):
            grad = torch.empty(MB // 4)
            trace.categorize([grad], GRADIENTS)
    phase = trace["backward"]
    assert phase.peak[GRADIENTS] == MB and phase.peak[ACTIVATIONS] == 0
    assert phase.peak[OPTIMIZER] == 0 and phase.total == 2 * MB


def test_storage_resized_like_fsdp2_unsharded_parameters_counts_while_allocated():
    with FakeTensorMode():
        unsharded = torch.empty(MB // 2, dtype=torch.bfloat16)  # allocated before the trace, then freed by resize_
        storage = unsharded.untyped_storage()
        storage.resize_(0)
        trace = MemoryTrace()
        with trace:
            with trace.phase("gathered"):
                storage.resize_(MB)  # all-gathered into: 1 MiB
                storage.resize_(0)   # resharded
            with trace.phase("after"):
                pass
    assert trace["gathered"].peak[GATHERED] == MB
    assert trace["after"].total == 0


def test_dtensor_shards_are_counted_by_their_local_storage():
    with fake_world(4) as mesh:
        full = torch.empty(8, 1024)
        sharded = distribute_tensor(full, mesh, [Shard(0)])
        storages = tensor_storages(sharded)
        assert [s.nbytes() for s in storages] == [2 * 1024 * 4]  # rank 1's two rows
        trace = MemoryTrace()
        trace.track([sharded], WEIGHTS)
        assert trace.live_bytes(WEIGHTS) == 2 * 1024 * 4


def test_collectives_are_recorded_with_their_full_buffers():
    with fake_world(4):
        trace = MemoryTrace()
        with trace, trace.phase("comm"):
            shard = torch.empty(1024, dtype=torch.bfloat16)
            gathered = torch.empty(4 * 1024, dtype=torch.bfloat16)
            dist.all_gather_into_tensor(gathered, shard)
            grads = torch.empty(4 * 1024)
            out = torch.empty(1024)
            dist.reduce_scatter_tensor(out, grads)
            dist.all_reduce(out)
    kinds = [(c.kind, c.nbytes, c.dtype) for c in trace["comm"].collectives]
    assert kinds == [("all_gather", 4 * 1024 * 2, "bf16"), ("reduce_scatter", 4 * 1024 * 4, "fp32"),
                     ("all_reduce", 1024 * 4, "fp32")]
    assert not dist.is_initialized()  # the fake world is torn down


def test_fake_world_refuses_an_initialised_process_group_and_dtype_names():
    with fake_world(2):
        with pytest.raises(RuntimeError, match="already initialised"):
            with fake_world(2):
                pass
    with pytest.raises(ValueError, match="at least one rank"):
        with fake_world(0):
            pass
    assert [dtype_name(d) for d in (torch.bfloat16, torch.float32, torch.int64)] == ["bf16", "fp32", "int64"]


def test_phases_do_not_nest_and_offload_changes_only_between_phases():
    trace = MemoryTrace()
    with trace, trace.phase("outer"):
        with pytest.raises(RuntimeError, match="inside another phase"):
            with trace.phase("inner"):
                pass
        with pytest.raises(RuntimeError, match="between phases"):
            trace.set_on_device([], False)
    with pytest.raises(KeyError, match="no traced phase 'missing'"):
        trace["missing"]
