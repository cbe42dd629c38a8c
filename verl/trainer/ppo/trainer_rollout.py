"""The trainer's generation side: prompt batches -> scored rollouts, with optional dynamic sampling.

One generation batch: a uid per prompt, ``repeat(rollout.n, interleave=True)``, the ReMax greedy baseline if
needed, generation (the ``rollout_loop`` plug-in; by default single-turn generation by the worker group) and the
reward plug-in. With ``algorithm.filter_groups.enable`` the trainer draws further prompt batches from the data
loader until ``data.train_batch_size`` prompt groups with a signal are collected (:mod:`verl.trainer.ppo.filter_groups`).
The ``rollout/*`` metrics a rollout loop reports in its output's ``meta_info['metrics']`` are kept and logged; a
single generation's ``meta_info['policy_version']`` becomes the batch's ``rollout_policy_versions`` when the loop
did not record one per token.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np
import torch

from verl.protocol import DataProto
from verl.trainer.config_schema import PPOTrainerConfig
from verl.trainer.ppo.filter_groups import GroupFilter
from verl.trainer.ppo.plugins import RolloutLoop
from verl.trainer.ppo.metric_utils import timer
from verl.workers.rollout.engine import POLICY_VERSION, ROLLOUT_POLICY_VERSIONS

logger = logging.getLogger(__name__)

GEN_INPUT_KEYS = ["input_ids", "attention_mask", "position_ids"]


def compute_response_mask(data: DataProto) -> torch.Tensor:
    """The response part of ``attention_mask`` (1 on generated tokens up to and including EOS)."""
    response_length = data.batch["responses"].shape[-1]
    return data.batch["attention_mask"][:, -response_length:]


def pop_metrics(out: DataProto) -> dict[str, Any]:
    """Remove and return ``out.meta_info['metrics']`` (empty if none), clearing the rest of ``meta_info``."""
    metrics = out.meta_info.pop("metrics", {}) or {}
    out.meta_info.clear()
    return metrics


def merge_rollout_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """The metrics of several generation batches as one set: durations (names ending in ``_s``) are summed,
    every other value (rates, means, per-batch counts) is averaged over the batches that report it."""
    merged: dict[str, list[float]] = {}
    for part in parts:
        for key, value in part.items():
            merged.setdefault(key, []).append(float(value))
    return {key: float(np.sum(v) if key.endswith("_s") else np.mean(v)) for key, v in merged.items()}


def add_uids(batch: DataProto, tag: str) -> None:
    """Give every row of ``batch`` its prompt id ``<tag>_<row>`` (``non_tensor_batch['uid']``)."""
    batch.non_tensor_batch["uid"] = np.array([f"{tag}_{i}" for i in range(len(batch))], dtype=object)


class StepRollouts:
    """A step's generation side: rollouts of prompt batches, scored by the reward plug-in.

    ``rollout_loop`` / ``val_rollout_loop`` generate for training and validation; ``reward_fn`` scores a batch
    (``data -> (scores, metrics)``); ``next_prompts`` draws the next prompt batch from the data loader (dynamic
    sampling asks for more).
    """

    def __init__(self, config: PPOTrainerConfig, rollout_loop: RolloutLoop, val_rollout_loop: RolloutLoop,
                 reward_fn: Callable[[DataProto], tuple[torch.Tensor, dict[str, float]]],
                 next_prompts: Callable[[], DataProto]) -> None:
        self.config = config
        self.rollout_loop = rollout_loop
        self.val_rollout_loop = val_rollout_loop
        self.reward_fn = reward_fn
        self.next_prompts = next_prompts

    def generate(self, batch: DataProto, meta_info: dict[str, Any], validation: bool) -> dict[str, float]:
        """Generate for the rows of ``batch`` and merge the generation keys into it (in place); return the
        rollout's own metrics (``meta_info['metrics']`` of its output)."""
        loop = self.val_rollout_loop if validation else self.rollout_loop
        tensors = batch.pop(batch_keys=GEN_INPUT_KEYS)
        gen_batch = DataProto(batch=tensors.batch, non_tensor_batch=dict(batch.non_tensor_batch),
                              meta_info=dict(meta_info))
        return self._merge_generation(batch, loop.run_llm_loop(gen_batch))

    @staticmethod
    def _merge_generation(batch: DataProto, out: DataProto) -> dict[str, float]:
        """Merge a rollout loop's output ``out`` into ``batch`` (the rows without their generation inputs), in
        place; return the rollout's own metrics."""
        if len(out) != len(batch):
            raise ValueError(f"the rollout returned {len(out)} rows for {len(batch)} prompts")
        version = out.meta_info.get(POLICY_VERSION)
        metrics = pop_metrics(out)
        batch.union(DataProto(batch=out.batch))
        batch.non_tensor_batch.update(out.non_tensor_batch)
        if "response_mask" not in batch.batch.keys():
            batch.batch["response_mask"] = compute_response_mask(batch)
        if ROLLOUT_POLICY_VERSIONS not in batch.batch.keys() and isinstance(version, int):  # one generation call
            mask = batch.batch["response_mask"].bool()
            batch.batch[ROLLOUT_POLICY_VERSIONS] = torch.where(mask, version, -1).to(torch.long)
        return {key: float(value) for key, value in metrics.items()}

    def _remax_baselines(self, batch: DataProto) -> None:
        """ReMax: the reward of a greedy response per row, stored as ``reward_baselines``."""
        greedy = DataProto(batch=batch.batch.clone(), non_tensor_batch=dict(batch.non_tensor_batch))
        self.generate(greedy, {"do_sample": False}, validation=False)
        scores, _ = self.reward_fn(greedy)
        batch.batch["reward_baselines"] = scores.sum(dim=-1)

    def _rollout_prompt_batch(self, prompts: DataProto, tag: str,
                              timing: dict[str, float]) -> tuple[DataProto, np.ndarray, dict[str, float]]:
        """Generate ``rollout.n`` responses per prompt and score them: the scored rows, each row's prompt id
        (the uid the trainer gave its prompt, kept even where the rollout loop re-keys a row), the rollout's and
        the reward plug-in's metrics."""
        add_uids(prompts, tag)
        batch = prompts.repeat(repeat_times=self.config.actor_rollout_ref.rollout.n, interleave=True)
        prompt_ids = batch.non_tensor_batch["uid"].copy()
        if self.config.algorithm.adv_estimator == "remax":
            with timer("gen_max", timing):
                self._remax_baselines(batch)
        with timer("gen", timing):
            metrics = self.generate(batch, {}, validation=False)
        metrics.update(self._score(batch, timing))
        return batch, prompt_ids, metrics

    def _score(self, batch: DataProto, timing: dict[str, float]) -> dict[str, float]:
        """Score the generated ``batch`` with the reward plug-in (``token_level_scores``, in place, timed as
        ``reward``); return its metrics under ``reward/``."""
        with timer("reward", timing):
            scores, reward_metrics = self.reward_fn(batch)
            batch.batch["token_level_scores"] = scores.to(torch.float32)
        return {f"reward/{k}": v for k, v in reward_metrics.items()}

    def start_train_batch(self, prompts: DataProto, step: int) -> Callable[[dict[str, float]],
                                                                         tuple[DataProto, dict[str, float]]]:
        """Step ``step``'s rollout of ``prompts`` started now (``RolloutLoop.start_llm_loop``: what depends on the
        order of the rollouts is done on this thread) and finished by the returned ``finish(timing)``: generation
        and reward, from any thread, beside other started rollouts; it returns what :meth:`train_batch` does.
        Without dynamic sampling or ReMax (refused with several rollouts in flight)."""
        cfg = self.config
        if cfg.algorithm.filter_groups.enable or cfg.algorithm.adv_estimator == "remax":
            raise RuntimeError("a rollout started ahead cannot draw more prompt batches (algorithm.filter_groups) "
                               "or generate a greedy baseline (ReMax)")
        add_uids(prompts, f"s{step}")
        batch = prompts.repeat(repeat_times=cfg.actor_rollout_ref.rollout.n, interleave=True)
        tensors = batch.pop(batch_keys=GEN_INPUT_KEYS)
        run = self.rollout_loop.start_llm_loop(DataProto(batch=tensors.batch,
                                                         non_tensor_batch=dict(batch.non_tensor_batch)))

        def finish(timing: dict[str, float]) -> tuple[DataProto, dict[str, float]]:
            with timer("gen", timing):
                metrics = self._merge_generation(batch, run())
            metrics.update(self._score(batch, timing))
            return batch, metrics
        return finish

    def train_batch(self, prompts: DataProto, step: int, timing: dict[str, float]) -> tuple[DataProto, dict[str, float]]:
        """The scored training batch of step ``step`` starting from the prompt batch ``prompts``, and its rollout,
        reward and (with ``algorithm.filter_groups.enable``) ``filter_groups/*`` metrics.

        With filtering, further prompt batches are drawn from the loader until ``data.train_batch_size`` groups
        with a signal are collected; past ``max_num_gen_batches`` (> 0) generation batches it raises RuntimeError.
        """
        cfg = self.config
        tag = f"s{step}"
        if not cfg.algorithm.filter_groups.enable:
            batch, _, metrics = self._rollout_prompt_batch(prompts, tag, timing)
            return batch, metrics
        filt = cfg.algorithm.filter_groups
        groups = GroupFilter(cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n, filt.metric)
        parts: list[dict[str, float]] = []
        while True:
            index = groups.stats.num_gen_batches
            batch, prompt_ids, metrics = self._rollout_prompt_batch(
                prompts, tag if index == 0 else f"{tag}.{index}", timing)
            groups.add(batch, prompt_ids)
            parts.append(metrics)
            if groups.full:
                break
            if 0 < filt.max_num_gen_batches <= groups.stats.num_gen_batches:
                raise RuntimeError(
                    f"algorithm.filter_groups: {groups.stats.num_gen_batches} generation batches "
                    f"(max_num_gen_batches={filt.max_num_gen_batches}) gave only {groups.kept} of "
                    f"{cfg.data.train_batch_size} prompt groups whose {filt.metric!r} values differ "
                    f"({groups.stats.groups_zero_signal} of {groups.stats.groups_generated} groups had one value "
                    "for all samples); the task may be too hard or too easy for the policy: raise "
                    "max_num_gen_batches (0 = no limit) or turn filtering off")
            logger.info("filter_groups: %d of %d groups with a signal after %d generation batch(es); generating more",
                        groups.kept, cfg.data.train_batch_size, groups.stats.num_gen_batches)
            prompts = self.next_prompts()
        metrics = merge_rollout_metrics(parts)
        metrics.update(groups.stats.metrics(cfg.data.train_batch_size))
        return groups.batch(), metrics
