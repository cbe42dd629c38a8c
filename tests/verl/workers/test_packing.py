"""Padding-free packing (verl.workers.packing), packed attention and token-budget micro-batches, checked against
independent computations: per-row loops, each sequence run alone, brute-force partition checks."""

from __future__ import annotations

import logging

import pytest
import torch
from tensordict import TensorDict
from transformers import AutoModelForCausalLM

from verl.utils.fsdp_offload import FSDPOffloader
from verl.utils.packed_attention import PACKED_SDPA, enable_packed_attention
from verl.workers.batching import restore_row_order, split_micro_batches, token_budget_partition
from verl.workers.packing import pack_batch, packed_log_probs

from tests.helpers.ppo_batch_helpers import make_dialogue_batch

pytestmark = pytest.mark.oldest  # also run under the lowest declared transformers (.venv-vllm)

PROMPT, RESPONSE = 12, 24


@pytest.fixture(scope="module")
def packed_model(tiny_model_path):
    """The tiny causal LM in fp32 with the packed attention enabled."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    assert enable_packed_attention(model, "test") == PACKED_SDPA
    return model


def test_pack_batch_layout_matches_a_per_row_loop():
    batch = make_dialogue_batch(7, 100, PROMPT, RESPONSE, seed=1).batch
    packed = pack_batch(batch["input_ids"], batch["attention_mask"], batch["position_ids"], RESPONSE)
    ids, pos, bounds, sources, scored = [], [], [0], [], torch.zeros(7, RESPONSE, dtype=torch.bool)
    for row in range(7):
        cols = [c for c in range(PROMPT + RESPONSE) if batch["attention_mask"][row, c]]
        offset = len(ids)
        ids += [int(batch["input_ids"][row, c]) for c in cols]
        pos += [int(batch["position_ids"][row, c]) for c in cols]
        bounds.append(len(ids))
        for j in range(RESPONSE):
            col = PROMPT + j
            if col in cols and col - 1 in cols:
                scored[row, j] = True
                sources.append(offset + cols.index(col - 1))
    assert packed.input_ids.tolist() == [ids] and packed.position_ids.tolist() == [pos]
    assert packed.cu_seqlens.tolist() == bounds and packed.cu_seqlens.dtype == torch.int32
    assert packed.max_seqlen == max(b - a for a, b in zip(bounds, bounds[1:]))
    assert packed.logit_index.tolist() == sources
    assert torch.equal(packed.scored, scored)
    # every scored source is followed by its response token in the packed row
    assert torch.equal(packed.input_ids[0, packed.logit_index + 1], batch["responses"][scored])
    values = torch.arange(1.0, len(sources) + 1)
    laid_out = packed.to_response_layout(values)
    assert torch.equal(laid_out[scored], values) and not laid_out[~scored].any()


def test_pack_batch_rejects_bad_shapes():
    ids = torch.ones(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="share one"):
        pack_batch(ids, torch.ones(2, 4), ids, 2)
    with pytest.raises(ValueError, match="do not fit"):
        pack_batch(ids, torch.ones_like(ids), ids, 5)


def test_packed_forward_equals_each_sequence_run_alone(packed_model):
    """The attention keeps packed sequences apart: each row's log-probs equal a forward of that row alone,
    unpadded (a third code path, neither the packed nor the padded batch)."""
    data = make_dialogue_batch(5, packed_model.config.vocab_size, PROMPT, RESPONSE, seed=2).batch
    with torch.no_grad():
        packed, _ = packed_log_probs(packed_model, data, 1.0, calculate_entropy=False, entropy_grad=False)
        for row in range(5):
            mask = data["attention_mask"][row].bool()
            ids = data["input_ids"][row][mask].unsqueeze(0)
            logits = packed_model(input_ids=ids, position_ids=data["position_ids"][row][mask].unsqueeze(0)).logits[0]
            attended_response = int(data["attention_mask"][row, PROMPT:].sum())
            targets = ids[0, -attended_response:]
            expected = torch.log_softmax(logits[-attended_response - 1 : -1], -1).gather(-1, targets[:, None])[:, 0]
            torch.testing.assert_close(packed[row, :attended_response], expected, atol=1e-5, rtol=1e-5)
            assert not packed[row, attended_response:].any()


def test_padded_calls_of_the_packed_attention_are_plain_sdpa(tiny_model_path, packed_model):
    """The same model still serves padded batches (and generation) exactly like transformers' sdpa."""
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    data = make_dialogue_batch(4, plain.config.vocab_size, PROMPT, RESPONSE, seed=3).batch
    inputs = {k: data[k] for k in ("input_ids", "attention_mask", "position_ids")}
    with torch.no_grad():
        torch.testing.assert_close(packed_model(**inputs).logits, plain(**inputs).logits, atol=1e-6, rtol=1e-6)
        prompt = {"input_ids": data["input_ids"][:, :PROMPT], "attention_mask": data["attention_mask"][:, :PROMPT]}
        kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 3}
        assert torch.equal(packed_model.generate(**prompt, **kwargs), plain.generate(**prompt, **kwargs))


def _check_partition(parts: list[list[int]], lengths: list[int], budget: int) -> None:
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    assert all(p and p == sorted(p) for p in parts)
    assert all(sum(lengths[i] for i in p) <= budget for p in parts)


@pytest.mark.parametrize("seed", range(20))
def test_token_budget_partition_respects_the_budget_with_few_micro_batches(seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 400, (int(torch.randint(1, 40, (1,), generator=gen)),), generator=gen).tolist()
    budget = max(lengths) + int(torch.randint(0, 800, (1,), generator=gen))
    parts = token_budget_partition(lengths, budget, "key")
    _check_partition(parts, lengths, budget)
    lower_bound = -(-sum(lengths) // budget)
    assert lower_bound <= len(parts) <= max(lower_bound + 2, 1)  # close to the fewest possible micro-batches


def test_token_budget_partition_errors_name_the_key():
    with pytest.raises(ValueError, match="ppo_max_token_len_per_gpu=10 is smaller than the longest row"):
        token_budget_partition([5, 11], 10, "ppo_max_token_len_per_gpu")
    with pytest.raises(ValueError, match="must be >= 1"):
        token_budget_partition([5], 0, "ppo_max_token_len_per_gpu")
    # rows without tokens still land in non-empty micro-batches
    _check_partition(token_budget_partition([0, 0, 7, 0], 7, "k"), [0, 0, 7, 0], 7)


def test_split_micro_batches_and_restore_row_order():
    data = make_dialogue_batch(9, 100, PROMPT, RESPONSE, seed=4).batch
    micros, parts = split_micro_batches(data, 0, 60, "budget")
    assert parts is not None and len(micros) > 1
    for micro, part in zip(micros, parts):
        assert torch.equal(micro["input_ids"], data["input_ids"][part])
        assert int(micro["attention_mask"].sum()) <= 60
    restored = restore_row_order([m["input_ids"] for m in micros], parts)
    assert torch.equal(restored, data["input_ids"])
    fixed, none = split_micro_batches(data, 4, None, "budget")
    assert none is None and [m.batch_size[0] for m in fixed] == [4, 4, 1]
    assert torch.equal(restore_row_order([m["input_ids"] for m in fixed], None), data["input_ids"])


def test_offload_is_a_no_op_on_cpu_that_says_so_once(caplog):
    module = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(module.parameters())
    module(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with caplog.at_level(logging.INFO, logger="verl.utils.fsdp_offload"):
        offloaders = [FSDPOffloader(module, optimizer, True, True, "test.fsdp_config") for _ in range(2)]
    assert [r.getMessage() for r in caplog.records].count(
        "test.fsdp_config: param_offload/optimizer_offload have no effect on cpu (parameters and optimizer state "
        "already live in CPU memory)"
    ) == 1
    for offloader in offloaders:
        assert not offloader.active
        offloader.offload()
        with offloader.on_device(with_optimizer=True):
            assert next(module.parameters()).device.type == "cpu"
    for key, value in module.state_dict().items():
        assert torch.equal(value, before[key])
    assert all(v.device.type == "cpu" for s in optimizer.state.values() for v in s.values())


def test_restore_row_order_handles_tensordict_rows():
    td = TensorDict({"x": torch.arange(6).unsqueeze(1)}, batch_size=[6])
    micros, parts = split_micro_batches(td.update({"attention_mask": torch.ones(6, 2)}), 0, 4, "k")
    assert restore_row_order([m["x"] for m in micros], parts).flatten().tolist() == list(range(6))
