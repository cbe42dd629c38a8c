"""Mini-/micro-batching and global loss normalisation shared by the PPO actor and critic.

The loss of a mini-batch is normalised by counts taken over *all* data-parallel ranks (loss tokens and
non-empty sequences), so the summed micro-batch losses, averaged over ranks by FSDP's gradient reduction,
equal the loss of the whole mini-batch whatever the DP world size and micro-batch split.
"""

from __future__ import annotations

import logging
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


def response_logits(logits: torch.Tensor, response_length: int, temperature: float) -> torch.Tensor:
    """Logits predicting each response token (positions ``-R-1 .. -2``), in fp32 and divided by ``temperature``."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 to compute log-probs, got {temperature}")
    if not 0 < response_length < logits.size(1):
        raise ValueError(
            f"responses of length {response_length} do not fit in input_ids of length {logits.size(1)}: "
            "input_ids must be the prompt followed by the responses"
        )
    return logits[:, -response_length - 1 : -1, :].float() / temperature


def append_metrics(metrics: dict[str, list[float]], values: dict[str, Any]) -> None:
    """Append each value (tensor or number) of ``values`` to the list under its name in ``metrics``."""
    for name, value in values.items():
        metrics.setdefault(name, []).append(value.item() if isinstance(value, torch.Tensor) else float(value))
