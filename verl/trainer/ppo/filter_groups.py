"""Dynamic sampling (DAPO, veRL's ``algorithm.filter_groups``): keep only prompt groups that carry a GRPO signal.

A group whose samples all got the same value of the filter metric (e.g. every dialogue of a prompt failed, or
every one completed) has zero advantage under GRPO: it adds nothing to the policy gradient but still dilutes
the loss normalisation. With filtering on, the trainer drops such groups and generates further prompt batches
until ``data.train_batch_size`` prompts with a signal are collected (see :class:`GroupFilter`).

Groups are the trainer's prompts (each generated ``rollout.n`` times). A rollout loop may give some rows of a
prompt their own ``uid`` (e.g. a dialogue that failed for an infrastructure reason gets a uid of its own, so it
is left out of its prompt's GRPO statistics); the signal is therefore judged per ``uid`` group: a prompt is
kept when at least one of its ``uid`` groups has two or more rows whose metric values are not all equal. A
``uid`` group of one row carries no within-group signal.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from verl.protocol import DataProto

TENSOR_METRICS = {"seq_reward": "token_level_scores", "seq_final_reward": "token_level_rewards"}


def filter_metric_values(batch: DataProto, metric: str) -> np.ndarray:
    """One value per row of the metric named ``algorithm.filter_groups.metric``.

    ``seq_reward``: the row's summed ``token_level_scores`` (the reward plug-in's output); ``seq_final_reward``:
    its summed ``token_level_rewards`` (the scores after an in-reward KL penalty; the scores themselves before
    one is applied, which is when the trainer filters); any other name: the per-row ``non_tensor_batch``
    column of that name (e.g. a column the rollout loop or the reward plug-in adds).
    """
    if metric in TENSOR_METRICS:
        key = TENSOR_METRICS[metric]
        if metric == "seq_final_reward" and batch.batch is not None and key not in batch.batch.keys():
            key = TENSOR_METRICS["seq_reward"]
        if batch.batch is None or key not in batch.batch.keys():
            raise KeyError(f"algorithm.filter_groups.metric={metric!r} needs batch[{key!r}], which is not computed yet")
        return batch.batch[key].sum(dim=-1).double().numpy()
    if metric not in batch.non_tensor_batch:
        raise KeyError(f"algorithm.filter_groups.metric={metric!r} is neither {sorted(TENSOR_METRICS)} nor a per-row "
                       f"column of the batch; columns: {sorted(batch.non_tensor_batch)}")
    return np.asarray(batch.non_tensor_batch[metric])


def prompts_with_signal(prompt_ids: Sequence[Hashable], uids: Sequence[Hashable],
                        values: Sequence[object]) -> tuple[list[Hashable], set[Hashable]]:
    """The prompts in first-appearance order, and those with a signal (see the module docstring).

    ``prompt_ids``, ``uids`` and ``values`` have one entry per row.
    """
    if not len(prompt_ids) == len(uids) == len(values):
        raise ValueError(f"prompt_ids ({len(prompt_ids)}), uids ({len(uids)}) and values ({len(values)}) must have "
                         "one entry per row")
    group_values: dict[Hashable, list[object]] = {}
    group_prompt: dict[Hashable, Hashable] = {}
    for prompt, uid, value in zip(prompt_ids, uids, values):
        if group_prompt.setdefault(uid, prompt) != prompt:
            raise ValueError(f"uid {uid!r} spans two prompts ({group_prompt[uid]!r} and {prompt!r})")
        group_values.setdefault(uid, []).append(value)
    with_signal = {group_prompt[uid] for uid, vals in group_values.items()
                   if len(vals) > 1 and any(v != vals[0] for v in vals[1:])}
    return list(dict.fromkeys(prompt_ids)), with_signal


@dataclass
class FilterStats:
    """What filtering did in one training step (logged as ``filter_groups/*``)."""

    num_gen_batches: int = 0
    groups_generated: int = 0
    groups_zero_signal: int = 0
    groups_surplus: int = 0

    def metrics(self, groups_kept: int) -> dict[str, float]:
        """The step's ``filter_groups/*`` metrics, ``groups_kept`` being the groups of the trained batch."""
        return {"filter_groups/num_gen_batches": float(self.num_gen_batches),
                "filter_groups/groups_generated": float(self.groups_generated),
                "filter_groups/groups_kept": float(groups_kept),
                "filter_groups/groups_zero_signal": float(self.groups_zero_signal),
                "filter_groups/groups_surplus": float(self.groups_surplus),
                "filter_groups/zero_signal_frac": self.groups_zero_signal / max(self.groups_generated, 1)}


class GroupFilter:
    """Collects the prompt groups with a signal from successive generation batches of one training step.

    ``add`` one scored generation batch at a time (rows of a prompt consecutive, ``rows_per_prompt`` each);
    once ``full``, ``batch()`` is the first ``num_prompts`` kept groups in generation order (later kept groups
    are surplus and dropped, as veRL's DAPO trainer truncates to the train batch size).
    """

    def __init__(self, num_prompts: int, rows_per_prompt: int, metric: str):
        if num_prompts < 1 or rows_per_prompt < 2:
            raise ValueError(f"need num_prompts >= 1 and rows_per_prompt >= 2, got {num_prompts}, {rows_per_prompt}")
        self.num_prompts, self.rows_per_prompt, self.metric = num_prompts, rows_per_prompt, metric
        self.stats = FilterStats()
        self._parts: list[DataProto] = []
        self._kept = 0

    @property
    def kept(self) -> int:
        """Groups with a signal collected so far (at most ``num_prompts``)."""
        return self._kept

    @property
    def full(self) -> bool:
        """Whether ``num_prompts`` groups with a signal have been collected."""
        return self._kept >= self.num_prompts

    def add(self, batch: DataProto, prompt_ids: Sequence[Hashable]) -> None:
        """Keep the groups of ``batch`` (one generation batch, scored) that carry a signal and are still needed."""
        order, with_signal = prompts_with_signal(prompt_ids, batch.non_tensor_batch["uid"],
                                                 filter_metric_values(batch, self.metric))
        if len(batch) != len(order) * self.rows_per_prompt:
            raise ValueError(f"a generation batch of {len(batch)} rows holds {len(order)} prompts, not "
                             f"{self.rows_per_prompt} rows each")
        needed = [p for p in order if p in with_signal][:max(self.num_prompts - self._kept, 0)]
        self.stats.num_gen_batches += 1
        self.stats.groups_generated += len(order)
        self.stats.groups_zero_signal += len(order) - len(with_signal)
        self.stats.groups_surplus += len(with_signal) - len(needed)
        if needed:
            wanted = set(needed)
            self._parts.append(batch.select_idxs([i for i, p in enumerate(prompt_ids) if p in wanted]))
            self._kept += len(needed)

    def batch(self) -> DataProto:
        """The collected groups as one batch of ``num_prompts * rows_per_prompt`` rows (only once ``full``)."""
        if not self.full:
            raise RuntimeError(f"only {self._kept} of {self.num_prompts} groups with a signal collected")
        return self._parts[0] if len(self._parts) == 1 else DataProto.concat(self._parts)
