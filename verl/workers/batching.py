"""Mini-/micro-batching (fixed row counts or token budgets) and global loss normalisation of the actor and critic.

The loss of a mini-batch is normalised by counts taken over *all* data-parallel ranks (loss tokens and
non-empty sequences), so the summed micro-batch losses, averaged over ranks by FSDP's gradient reduction,
equal the loss of the whole mini-batch whatever the DP world size and micro-batch split. Token-budget
micro-batches (``use_dynamic_bsz``) therefore need no extra loss scale: their gradient is the fixed-size path's.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl.protocol import DP_PAD_ROWS_KEY, DataProto

logger = logging.getLogger(__name__)


def dp_world_size() -> int:
    """Data-parallel world size: the default process group's size, 1 without torch.distributed."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def global_loss_info(response_mask: torch.Tensor, loss_scale_factor: float | None = None) -> dict[str, Any]:
    """``agg_loss`` keyword arguments for one mini-batch: its loss tokens and non-empty rows over all ranks, and
    the ``seq-mean-token-sum-norm`` divisor ``loss_scale_factor`` (None: the padded response length).

    A collective when torch.distributed is initialised: every rank must call it for every mini-batch.
    """
    counts = torch.stack([response_mask.sum(), (response_mask.sum(dim=-1) > 0).sum()]).to(torch.float64)
    dp_size = dp_world_size()
    if dp_size > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    return {"dp_size": dp_size, "batch_num_tokens": counts[0].item(), "global_batch_size": counts[1].item(),
            "loss_scale_factor": loss_scale_factor}


def mask_padding_rows(data: DataProto, where: str) -> DataProto:
    """``data`` with ``response_mask`` zeroed on the padding rows the DP dispatch appended (see ``DP_PAD_ROWS_KEY``).

    Those rows repeat rows another rank trains on; with no loss tokens they add nothing to the loss, to its
    global token/sequence counts or to the metrics. Returns ``data`` itself when it holds no padding.
    """
    pad_rows = int(data.meta_info.get(DP_PAD_ROWS_KEY, 0))
    if pad_rows == 0 or data.batch is None or "response_mask" not in data.batch.keys():
        return data
    if not 0 < pad_rows <= len(data):
        raise ValueError(f"{where}: meta_info[{DP_PAD_ROWS_KEY!r}]={pad_rows} is outside [0, {len(data)}] rows")
    response_mask = data.batch["response_mask"].clone()
    response_mask[-pad_rows:] = 0
    batch = data.batch.copy()
    batch["response_mask"] = response_mask
    logger.info("%s: %d padding row(s) of the DP dispatch carry no loss", where, pad_rows)
    return DataProto(batch=batch, non_tensor_batch=data.non_tensor_batch, meta_info=data.meta_info)


def select_batch(data: DataProto, keys: Sequence[str], where: str) -> TensorDict:
    """The tensors ``keys`` of ``data.batch``; raise naming the missing keys and the calling method."""
    if data.batch is None:
        raise ValueError(f"{where}: the DataProto has no tensor batch; it needs {list(keys)}")
    missing = [k for k in keys if k not in data.batch.keys()]
    if missing:
        raise KeyError(f"{where}: batch is missing {missing}; it has {sorted(data.batch.keys())}")
    return data.batch.select(*keys)


def check_divisible(num_rows: int, size: int, what: str, where: str) -> None:
    """Raise unless ``size`` >= 1 divides ``num_rows`` (``what`` names the config key)."""
    if size < 1:
        raise ValueError(f"{where}: {what} must be >= 1, got {size}")
    if num_rows % size != 0:
        raise ValueError(f"{where}: this rank's batch of {num_rows} rows is not divisible by {what}={size}")


def iter_mini_batches(batch: TensorDict, mini_batch_size: int, epochs: int, shuffle: bool) -> Iterator[TensorDict]:
    """Yield consecutive mini-batches of ``mini_batch_size`` rows, ``epochs`` times.

    With ``shuffle`` the rows are permuted with the global torch RNG before each epoch (checkpointed, so a
    resumed run shuffles identically).
    """
    for _ in range(epochs):
        epoch_batch = batch[torch.randperm(batch.batch_size[0])] if shuffle else batch
        yield from epoch_batch.split(mini_batch_size)


def response_logits(logits: torch.Tensor, response_length: int) -> torch.Tensor:
    """Logits predicting each response token (positions ``-R-1 .. -2``): a view in the model's dtype, no copy (the
    temperature is applied chunk by chunk by :func:`verl.utils.torch_functional.log_probs_and_entropy`)."""
    if not 0 < response_length < logits.size(1):
        raise ValueError(
            f"responses of length {response_length} do not fit in input_ids of length {logits.size(1)}: "
            "input_ids must be the prompt followed by the responses"
        )
    return logits[:, -response_length - 1 : -1, :]


def append_metrics(metrics: dict[str, list[float]], values: dict[str, Any]) -> None:
    """Append each value (tensor or number) of ``values`` to the list under its name in ``metrics``."""
    for name, value in values.items():
        metrics.setdefault(name, []).append(value.item() if isinstance(value, torch.Tensor) else float(value))


def _balanced_parts(lengths: Sequence[int], num_parts: int) -> list[list[int]]:
    """Row indices split into ``num_parts`` non-empty parts of similar token sums (longest row first into the
    lightest part; ties go to the part with fewer rows), each part in ascending row order."""
    heap = [(0, 0, part) for part in range(num_parts)]
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    for row in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, count, part = heapq.heappop(heap)
        parts[part].append(row)
        heapq.heappush(heap, (load + lengths[row], count + 1, part))
    return [sorted(part) for part in parts]


def _max_over_ranks(value: int) -> int:
    """The largest ``value`` over all data-parallel ranks (a collective; ``value`` itself without distributed)."""
    if dp_world_size() == 1:
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def token_budget_partition(lengths: Sequence[int], max_token_len: int, key: str) -> list[list[int]]:
    """Rows grouped into micro-batches of at most ``max_token_len`` tokens (veRL's ``use_dynamic_bsz``).

    ``lengths`` are the rows' attended token counts. The number of micro-batches is the smallest count whose
    balanced split respects the budget, then the largest such count over all DP ranks, so every rank runs the
    same number of forward/backward passes (FSDP's collectives pair up). A collective under torch.distributed.
    ``key`` names the budget's config key in errors.

    As in veRL (0.10.0.dev, ``rearrange_micro_batches``) the count starts at ceil(tokens / budget), is synced to
    the maximum over DP ranks and the rows are balanced by size; unlike it, the balance is on token counts (not
    a FLOPs estimate) and the count grows until every micro-batch fits the budget.
    """
    if max_token_len < 1:
        raise ValueError(f"{key} must be >= 1, got {max_token_len}")
    longest = max(lengths, default=0)
    if longest > max_token_len:
        raise ValueError(
            f"{key}={max_token_len} is smaller than the longest row of the batch ({longest} tokens); "
            f"raise it to at least the longest prompt + response"
        )
    num_rows = len(lengths)
    num_parts = min(num_rows, max(1, math.ceil(sum(lengths) / max_token_len)))
    parts = _balanced_parts(lengths, num_parts)
    while num_parts < num_rows and max(sum(lengths[i] for i in p) for p in parts) > max_token_len:
        num_parts += 1
        parts = _balanced_parts(lengths, num_parts)
    synced = _max_over_ranks(num_parts)
    if synced > num_rows:
        raise ValueError(f"{key}: another rank needs {synced} micro-batches but this rank has only {num_rows} rows")
    return parts if synced == num_parts else _balanced_parts(lengths, synced)


def split_micro_batches(
    batch: TensorDict, micro_batch_size: int, max_token_len: int | None, key: str
) -> tuple[list[TensorDict], list[list[int]] | None]:
    """Micro-batches of ``batch``: ``micro_batch_size`` consecutive rows each, or with ``max_token_len`` (dynamic
    batch size) balanced groups of at most that many attended tokens (see :func:`token_budget_partition`).

    Returns the micro-batches and, for dynamic ones, the row indices of each (to restore the row order).
    """
    if max_token_len is None:
        return list(batch.split(micro_batch_size)), None
    lengths = batch["attention_mask"].sum(dim=-1).tolist()
    parts = token_budget_partition(lengths, int(max_token_len), key)
    return [batch[torch.tensor(part, dtype=torch.long)] for part in parts], parts


def restore_row_order(micro_outputs: list[torch.Tensor], parts: list[list[int]] | None) -> torch.Tensor:
    """Concatenate per-micro-batch outputs and put the rows back in the batch's order (``parts`` from
    :func:`split_micro_batches`; None: already in order)."""
    stacked = torch.cat(micro_outputs)
    if parts is None:
        return stacked
    order = torch.tensor([row for part in parts for row in part], dtype=torch.long)
    restored = torch.empty_like(stacked)
    restored[order] = stacked
    return restored
