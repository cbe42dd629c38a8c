"""The drop rule of bounded staleness: a dialogue whose oldest trained token is more than ``threshold`` policy
versions behind the trainer's is not trained on.

Its row stays in the batch (the batch's size and layout stay what the workers expect) with its ``response_mask``
zeroed, so none of its tokens enter the loss, and with a ``uid`` of its own, so its reward leaves its prompt's GRPO
group statistics (as a dialogue failed for an infrastructure reason does). A group whose every dialogue is dropped
trains nothing: the step trains on fewer groups. A step whose every dialogue is dropped is refused (RuntimeError):
it would train on nothing.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from verl.protocol import DataProto
from verl.workers.rollout.engine import ROLLOUT_POLICY_VERSIONS

logger = logging.getLogger(__name__)

__all__ = ["drop_stale_dialogues", "over_stale_rows"]


def over_stale_rows(batch: DataProto, version: int, threshold: int) -> torch.Tensor:
    """A bool per row: its oldest trained token (``response_mask``) is more than ``threshold`` versions behind
    ``version``."""
    mask = batch.batch["response_mask"].bool()
    versions = batch.batch[ROLLOUT_POLICY_VERSIONS]
    oldest = torch.where(mask, versions, torch.full_like(versions, version)).min(dim=1).values
    return (version - oldest) > threshold


def drop_stale_dialogues(batch: DataProto, version: int, threshold: int) -> dict[str, float]:
    """Apply the drop rule in place; returns ``async/dropped_stale_dialogues`` (rows dropped) and
    ``async/dropped_stale_groups`` (``uid`` groups all of whose trained rows were dropped). RuntimeError when every row
    with a trained token is dropped."""
    drop = over_stale_rows(batch, version, threshold)
    dropped = int(drop.sum())
    metrics = {"async/dropped_stale_dialogues": float(dropped), "async/dropped_stale_groups": 0.0}
    if not dropped:
        return metrics
    trained = batch.batch["response_mask"].bool().any(dim=1)
    if not bool((trained & ~drop).any()):
        raise RuntimeError(f"every dialogue of the batch is more than {threshold} policy versions behind the "
                           f"trainer's {version}: nothing is left to train on")
    rows = drop.nonzero().flatten().tolist()
    if "uid" in batch.non_tensor_batch:
        uids = batch.non_tensor_batch["uid"]
        kept = {uids[i] for i in range(len(batch)) if bool(trained[i]) and not bool(drop[i])}
        metrics["async/dropped_stale_groups"] = float(len({uids[i] for i in rows} - kept))
        batch.non_tensor_batch["uid"] = np.array([f"{u}#stale{i}" if bool(drop[i]) else u
                                                  for i, u in enumerate(uids)], dtype=object)
    batch.batch["response_mask"][drop] = 0
    logger.warning("async_training: %d dialogue(s) more than %d versions behind the trainer's %d dropped from the "
                   "loss (%d whole group(s))", dropped, threshold, version,
                   int(metrics["async/dropped_stale_groups"]))
    return metrics
