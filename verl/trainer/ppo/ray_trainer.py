"""The PPO/GRPO driver: RayPPOTrainer.fit() and the driver-side maths of one step (veRL names).

One training step: uid per prompt -> ``repeat(rollout.n, interleave=True)`` -> generation (the ``rollout_loop``
plug-in, a :class:`~verl.trainer.ppo.plugins.RolloutLoop`; single-turn by default) -> ``response_mask`` -> reward
plug-in -> (with ``algorithm.filter_groups``: drop the groups without a signal and generate more prompt batches
until the train batch is full; see :mod:`verl.trainer.ppo.trainer_rollout`) -> balance rows across DP ranks
(``DataProto.reorder`` moves every per-row field together) -> old log-probs (or, in rollout-correction bypass
mode, the rollout's) -> reference log-probs -> values -> KL in reward -> the advantage step
(:mod:`verl.trainer.ppo.trainer_advantage`: rollout correction, then advantages and ``algorithm.diagnosis_reweight``
on the dialogues as sampled, then the rejected tokens leave the loss, :mod:`verl.trainer.ppo.rollout_rejection`)
-> critic update -> actor update -> metrics (with the rollout's ``rollout/*``);
validation every ``test_freq`` and a checkpoint every ``save_freq`` steps (see :mod:`verl.utils.checkpoint`). With
``async_training.staleness_threshold=1`` the next step's rollout runs while a step trains
(:mod:`verl.trainer.ppo.trainer_off_policy`), with k >= 2 up to k steps' rollouts run ahead, ``rollouts_in_flight``
of them at once (:mod:`verl.trainer.ppo.trainer_rollout_stream`), on the actor's workers or on devices of their own
(:mod:`verl.trainer.ppo.trainer_placement`; docs/off_policy.md). Its parts: :class:`~.trainer_rollout.StepRollouts`
(generation and scoring) and :class:`~.trainer_checkpoint.TrainerCheckpoints` (save and resume).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import random
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from tqdm import tqdm

from verl.protocol import DataProto
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.trainer.config_async import in_flight_of, staleness_of
from verl.trainer.config_schema import PPOTrainerConfig
from verl.trainer.config_validation import load_config
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.balance import balance_batch
from verl.trainer.ppo.kl import apply_kl_penalty
from verl.trainer.ppo.plugins import RolloutLoop, bind_reward, import_dotted, rollout_loop_class
from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode
from verl.trainer.ppo.trainer_advantage import advantage_step, compute_advantage
from verl.trainer.ppo.trainer_checkpoint import (SCENARIO_KEY, CheckpointedParts, TrainerCheckpoints, nothing_to_train,
                                                 run_inputs)
from verl.trainer.ppo.trainer_off_policy import (RolloutAhead, TurnSignal, staleness_metrics, take_and_refill,
                                                 trainer_policy_version)
from verl.trainer.ppo.trainer_placement import StandaloneRollout, standalone_rollout
from verl.trainer.ppo.trainer_rollout_corr import actor_policy_loss, check_rollout_log_probs
from verl.trainer.ppo.trainer_rollout import (GEN_INPUT_KEYS, StepRollouts, add_uids, compute_response_mask,
                                              merge_rollout_metrics, pop_metrics)
from verl.trainer.ppo.trainer_rollout_stream import RolloutStream, check_starts_ahead, fill_limit
from verl.trainer.ppo.trainer_stale_drop import drop_stale_dialogues
from verl.trainer.ppo.validation_metrics import generation_rows
from verl.trainer.ppo.metric_utils import (
    compute_data_metrics,
    compute_throughout_metrics,
    compute_timing_metrics,
    format_console_line,
    reduce_metrics,
    setup_console_logger,
    timer,
)
from verl.utils.dataset import PromptLoader, create_dataset
from verl.utils.torch_functional import masked_mean
from verl.utils.tracking import Tracking
from verl.workers.rollout.replicas import WorkerGroupEngine

logger = logging.getLogger(__name__)

__all__ = ["GEN_INPUT_KEYS", "RayPPOTrainer", "Role", "apply_kl_penalty", "compute_advantage",
           "compute_response_mask", "import_dotted"]


class Role(str, Enum):
    """Worker roles the trainer places on the resource pool."""

    ActorRollout = "actor_rollout"
    Critic = "critic"


class RayPPOTrainer:
    """Drives PPO/GRPO training of the worker groups on ``resource_pool`` (see the module docstring).

    Args:
        config: the job config (``ppo_trainer.yaml`` composed with overrides).
        tokenizer: the left-padding tokenizer of the policy.
        role_worker_mapping: worker classes for ``Role.ActorRollout`` and (GAE) ``Role.Critic``.
        resource_pool: the pool both groups are colocated on (``max_colocate_count`` >= number of groups).
        reward_fn / val_reward_fn: override ``reward.path`` (same signature).
        train_dataset / val_dataset: override the datasets built from ``data.*``.
    """

    def __init__(self, config: DictConfig, tokenizer: Any, role_worker_mapping: Mapping[Role, type],
                 resource_pool: RayResourcePool, reward_fn: Optional[Callable] = None,
                 val_reward_fn: Optional[Callable] = None, train_dataset: Any = None, val_dataset: Any = None):
        self.typed: PPOTrainerConfig = load_config(config)
        self.config = OmegaConf.create(OmegaConf.to_container(config, resolve=True))
        self.tokenizer = tokenizer
        self.role_worker_mapping = dict(role_worker_mapping)
        self.resource_pool = resource_pool
        self.use_critic = self.typed.need_critic
        self.use_reference = self.typed.need_reference
        if self.use_critic and Role.Critic not in self.role_worker_mapping:
            raise ValueError(f"algorithm.adv_estimator={self.typed.algorithm.adv_estimator} needs a Role.Critic "
                             "worker class")
        kwargs = dict(self.typed.reward.kwargs)
        base_fn = reward_fn or import_dotted(self.typed.reward.path, "reward.path")
        self.reward_fn = bind_reward(base_fn, tokenizer, kwargs, self.typed.reward.path)
        self.val_reward_fn = bind_reward(val_reward_fn or base_fn, tokenizer, kwargs, self.typed.reward.path)
        self.loop_cls = rollout_loop_class(self.typed.rollout_loop.path)
        check_starts_ahead(self.loop_cls, in_flight_of(self.typed))
        data_cfg = self.typed.data
        if train_dataset is None:
            train_dataset = create_dataset(data_cfg.train_files, tokenizer, data_cfg)
        self.train_dataset = train_dataset
        if val_dataset is None and data_cfg.val_files:
            val_dataset = create_dataset(data_cfg.val_files, tokenizer, data_cfg)
        self.val_dataset = val_dataset
        self.train_loader = PromptLoader(self.train_dataset, data_cfg.train_batch_size, shuffle=data_cfg.shuffle,
                                         seed=data_cfg.seed, drop_last=True)
        self.total_training_steps = (self.typed.trainer.total_training_steps
                                     or len(self.train_loader) * self.typed.trainer.total_epochs)
        with open_dict(self.config):
            for key in ("actor_rollout_ref.model.path", "actor_rollout_ref.model.tokenizer_path", "critic.model.path"):
                value = OmegaConf.select(self.config, key)
                if value:  # workers may run in another directory
                    OmegaConf.update(self.config, key, str(Path(value).resolve()))
            self.config.actor_rollout_ref.actor.optim.total_training_steps = self.total_training_steps
            policy_loss = actor_policy_loss(self.typed.algorithm.rollout_correction)
            if policy_loss is not None:  # bypass mode: the actor's loss corrects against the rollout's log-probs
                self.config.actor_rollout_ref.actor.policy_loss = policy_loss
            self.config.critic.optim.total_training_steps = self.total_training_steps
        self.kl_ctrl = core_algos.get_kl_controller(dataclasses.asdict(self.typed.algorithm.kl_ctrl))
        self.checkpoints = TrainerCheckpoints(self.typed.trainer,
                                              str(Path(self.typed.actor_rollout_ref.model.path).resolve()),
                                              run_inputs(tokenizer, OmegaConf.select(self.config, SCENARIO_KEY)),
                                              run_config=OmegaConf.to_container(self.config, resolve=True),
                                              loader=self.train_loader.state_dict())
        self.global_steps = 0
        self.actor_rollout_wg: Optional[RayWorkerGroup] = None
        self.critic_wg: Optional[RayWorkerGroup] = None
        self.standalone: Optional[StandaloneRollout] = None  # the rollout on devices of its own (split placement)
        self.rollout_loop: Optional[RolloutLoop] = None
        self.val_rollout_loop: Optional[RolloutLoop] = None
        self.rollouts: Optional[StepRollouts] = None
        self.turn_signal: Optional[TurnSignal] = None  # the loops' engine in one-step-off training
        self._prompt_iter: Optional[Iterator[DataProto]] = None
        self._val_generations: list[list[str]] = []  # rows of the last validation's sample table
        self.last_batch: Optional[DataProto] = None  # the last trained batch (inspection and tests)

    # ------------------------------------------------------------------------------------------------ setup
    def init_workers(self) -> None:
        """Start the actor/rollout(/ref) group and, for GAE, the critic group; build the rollout-loop plug-in."""
        split = self.typed.actor_rollout_ref.rollout.n_gpus_per_node > 0  # the rollout's own group generates
        role = ("actor" if split else "actor_rollout") + ("_ref" if self.use_reference else "")
        actor_cls = RayClassWithInitArgs(self.role_worker_mapping[Role.ActorRollout],
                                         config=self.config.actor_rollout_ref, role=role)
        self.actor_rollout_wg = RayWorkerGroup(self.resource_pool, actor_cls, name_prefix="actor_rollout")
        if self.use_critic:
            critic_cls = RayClassWithInitArgs(self.role_worker_mapping[Role.Critic], config=self.config.critic)
            self.critic_wg = RayWorkerGroup(self.resource_pool, critic_cls, name_prefix="critic")
            self.critic_wg.init_model()
        self.actor_rollout_wg.init_model()
        self.standalone = standalone_rollout(self.typed, self.config.actor_rollout_ref, self.resource_pool.use_gpu)
        engine = self.standalone.engine if self.standalone is not None else WorkerGroupEngine(self.actor_rollout_wg)
        if staleness_of(self.typed) > 0:
            engine = self.turn_signal = TurnSignal(engine)
        self.rollout_loop = self.loop_cls(tokenizer=self.tokenizer, engine=engine,
                                          config=self.typed.rollout_loop.config, is_validation=False)
        self.val_rollout_loop = self.loop_cls(tokenizer=self.tokenizer, engine=engine,
                                              config=self.typed.rollout_loop.config, is_validation=True)
        self.rollouts = StepRollouts(self.typed, self.rollout_loop, self.val_rollout_loop, self.reward_fn,
                                     self._next_prompt_batch)

    def shutdown(self) -> None:
        """Close the rollout loops and stop the worker groups (idempotent)."""
        for loop in (self.rollout_loop, self.val_rollout_loop):
            if loop is not None:
                loop.close()
        self.rollout_loop = self.val_rollout_loop = None
        self.rollouts = None
        for part in (self.actor_rollout_wg, self.critic_wg, self.standalone):
            if part is not None:
                part.shutdown()
        self.actor_rollout_wg = self.critic_wg = self.standalone = None

    # ------------------------------------------------------------------------------------ data, checkpoints
    def _next_prompt_batch(self) -> DataProto:
        """The next training prompt batch; the loader's epochs follow one another without end."""
        if self._prompt_iter is None:
            self._prompt_iter = itertools.chain.from_iterable(itertools.repeat(self.train_loader))
        return next(self._prompt_iter)

    def _checkpointed(self) -> CheckpointedParts:
        return CheckpointedParts(self.actor_rollout_wg, self.critic_wg, self.train_loader, self.kl_ctrl,
                                 self.rollout_loop, None if self.standalone is None else self.standalone.worker_group)

    def check_resume_model(self) -> None:
        """Fail before any worker starts when the checkpoint to resume was trained from another model."""
        self.checkpoints.check_resume_model()

    def save_checkpoint(self) -> Path:
        """Write ``global_step_N`` for the current step (see :mod:`verl.trainer.ppo.trainer_checkpoint`)."""
        return self.checkpoints.save(self.global_steps, self.total_training_steps, self._checkpointed())

    def load_checkpoint(self) -> Optional[Path]:
        """Resume per ``trainer.resume_mode``; returns the checkpoint used (None: training from scratch)."""
        resumed = self.checkpoints.load(self._checkpointed())
        if resumed is not None:
            self.global_steps = resumed[1]
        return None if resumed is None else resumed[0]

    # --------------------------------------------------------------------------------------------- one step
    def train_step(self, batch: DataProto) -> dict[str, float]:
        """Run one PPO step on a prompt batch (its rows are consumed; with ``algorithm.filter_groups`` further
        prompt batches may be drawn from the loader); return the step's metrics."""
        timing: dict[str, float] = {}
        metrics: dict[str, float] = {}
        with timer("step", timing):
            batch, rollout_metrics = self.rollouts.train_batch(batch, self.global_steps, timing)
            metrics.update(rollout_metrics)
            batch = self._update(batch, metrics, timing)
        return self._step_metrics(batch, metrics, timing, self.rollout_loop.on_train_step_end(batch, self.global_steps))

    def off_policy_step(self, ahead: RolloutAhead, overlap_next: bool) -> dict[str, float]:
        """One one-step-off PPO step: take this step's rollout (started during the previous step, or now), let the
        loop see its outcomes, start the next step's when ``overlap_next``, train; the step's metrics (``async/*``)."""
        step, timing = self.global_steps, {}
        metrics: dict[str, float] = {}
        with timer("step", timing):
            taken, hook_metrics = take_and_refill(ahead, step, self._next_prompt_batch,
                                                  lambda batch: self.rollout_loop.on_train_step_end(batch, step),
                                                  overlap_next)
            batch = taken.batch
            timing.update(taken.timing)
            metrics.update(taken.metrics)
            version = trainer_policy_version(step, self.typed.trainer.critic_warmup)
            metrics.update(staleness_metrics(batch, version, staleness_of(self.typed)))
            batch = self._update(batch, metrics, timing)
        metrics.update({"async/trainer_idle_s": taken.trainer_idle_s, "async/rollout_idle_s": taken.rollout_idle_s})
        return self._step_metrics(batch, metrics, timing, hook_metrics)

    def stream_step(self, stream: RolloutStream, fill_to: int) -> dict[str, float]:
        """One bounded-staleness PPO step: take this step's rollout (queued earlier, or now) and its hook's metrics,
        queue the next steps' up to ``fill_to``, drop what the rule drops, train; the step's metrics (``async/*``)."""
        step, timing, threshold = self.global_steps, {}, staleness_of(self.typed)
        metrics: dict[str, float] = {}
        with timer("step", timing):
            if not stream.queued:  # nothing ahead (the first step, or after a boundary): queue what the bound allows
                stream.fill(min(fill_to, step + threshold - 1), self._next_prompt_batch, step - 1)
            taken, hook_metrics = stream.take(step)
            stream.fill(fill_to, self._next_prompt_batch, step)
            waited = stream.wait_until_generating() if stream.queued else 0.0
            batch = taken.batch
            timing.update(taken.timing)
            metrics.update(taken.metrics)
            version = trainer_policy_version(step, self.typed.trainer.critic_warmup)
            metrics.update(drop_stale_dialogues(batch, version, threshold))
            metrics.update(staleness_metrics(batch, version, threshold))
            batch = self._update(batch, metrics, timing)
        metrics.update({"async/trainer_idle_s": taken.trainer_idle_s + waited,
                        "async/rollout_idle_s": taken.rollout_idle_s,
                        "async/rollouts_queued": float(len(stream.queued))})
        return self._step_metrics(batch, metrics, timing, hook_metrics)

    def _update(self, batch: DataProto, metrics: dict[str, float], timing: dict[str, float]) -> DataProto:
        """The training part of a step on the scored ``batch``: balance, log-probs, values, advantages, updates
        (metrics and timings added to ``metrics`` and ``timing``); returns the trained batch."""
        cfg = self.typed
        n = cfg.actor_rollout_ref.rollout.n
        if cfg.trainer.balance_batch:
            metrics.update(balance_batch(batch, self.actor_rollout_wg.world_size))
        correction = cfg.algorithm.rollout_correction
        check_rollout_log_probs(batch, correction)
        if correction.bypass_mode:  # the rollout's log-probs are the old ones: no old-log-prob pass
            apply_bypass_mode(batch)
        else:
            with timer("old_log_prob", timing):
                out = self.actor_rollout_wg.compute_log_prob(batch)
                pop_metrics(out)
                entropys = out.batch.pop("entropys")
                metrics["actor/entropy"] = float(masked_mean(entropys, batch.batch["response_mask"]))
                batch.union(out)
        if self.use_reference:
            with timer("ref", timing):
                batch.union(self.actor_rollout_wg.compute_ref_log_prob(batch))
        if self.use_critic:
            with timer("values", timing):
                batch.union(self.critic_wg.compute_values(batch))
        with timer("adv", timing):
            if cfg.algorithm.use_kl_in_reward:
                batch, kl_metrics = apply_kl_penalty(batch, self.kl_ctrl, cfg.algorithm.kl_penalty)
                metrics.update(kl_metrics)
            else:
                batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
            metrics.update(advantage_step(batch, cfg.algorithm, num_repeat=n))
        if self.use_critic:
            with timer("update_critic", timing):
                metrics.update(reduce_metrics(pop_metrics(self.critic_wg.update_critic(batch))))
        if self.global_steps > cfg.trainer.critic_warmup:
            with timer("update_actor", timing):
                metrics.update(reduce_metrics(pop_metrics(self.actor_rollout_wg.update_actor(batch))))
            if self.standalone is not None:  # between two of the rollout's generation calls
                metrics.update(self.standalone.sync(self.actor_rollout_wg))
        return batch

    def _step_metrics(self, batch: DataProto, metrics: dict[str, float], timing: dict[str, float],
                      loop_metrics: dict[str, float]) -> dict[str, float]:
        """The step's metrics: ``metrics`` with the data, timing and throughput metrics of the trained ``batch``
        and the rollout loop's ``loop_metrics``; keeps ``batch`` as ``last_batch``."""
        metrics.update(compute_data_metrics(batch, self.use_critic))
        if metrics.get("critic/advantages/nonzero_frac") == 0.0:
            logger.warning("step %d has no learning signal: every advantage is 0 (the samples of each prompt group "
                           "got equal rewards), so the policy gradient is 0", self.global_steps)
        metrics.update(compute_timing_metrics(batch, timing))
        metrics.update(compute_throughout_metrics(batch, timing, self.actor_rollout_wg.world_size))
        metrics.update(loop_metrics)
        self.last_batch = batch
        return metrics

    # ------------------------------------------------------------------------------------------- validation
    def validate(self) -> dict[str, float]:
        """Generate for the whole validation set with ``rollout.val_kwargs`` and return ``val/*`` metrics."""
        if self.val_dataset is None:
            return {}
        val_kwargs = self.typed.actor_rollout_ref.rollout.val_kwargs
        meta = {"do_sample": val_kwargs.do_sample, "temperature": val_kwargs.temperature, "top_p": val_kwargs.top_p,
                "top_k": val_kwargs.top_k, "validate": True}
        loader = PromptLoader(self.val_dataset, self.typed.data.val_batch_size, shuffle=False, drop_last=False)
        scores_by_source: dict[str, list[float]] = {}
        reward_metrics: dict[str, list[float]] = {}
        lengths = []
        scored_batches: list[DataProto] = []
        sample_scores: list[float] = []
        rollout_metrics: list[dict[str, float]] = []
        for i, batch in enumerate(loader):
            add_uids(batch, f"val{self.global_steps}_{i}")
            batch = batch.repeat(repeat_times=val_kwargs.n, interleave=True)
            rollout_metrics.append(self.rollouts.generate(batch, meta, validation=True))
            scores, extra = self.val_reward_fn(batch)
            sources = batch.non_tensor_batch.get("data_source", np.array(["unknown"] * len(batch), dtype=object))
            for source, score in zip(sources, scores.sum(dim=-1).tolist()):
                scores_by_source.setdefault(str(source), []).append(score)
                sample_scores.append(score)
            for key, value in extra.items():
                reward_metrics.setdefault(key, []).extend([value] * len(batch))
            lengths.extend(batch.batch["response_mask"].sum(-1).tolist())
            scored_batches.append(batch)
        metrics = {f"val/test_score/{s}": float(np.mean(v)) for s, v in scores_by_source.items()}
        metrics.update({f"val/reward/{k}": float(np.mean(v)) for k, v in reward_metrics.items()})
        metrics["val/response_length/mean"] = float(np.mean(lengths))
        metrics.update({f"val/{k}": v for k, v in merge_rollout_metrics(rollout_metrics).items()})
        loop_metrics = self.val_rollout_loop.on_validation_end(scored_batches, self.global_steps)
        metrics.update({f"val/{k}": v for k, v in loop_metrics.items()})
        self._val_generations = generation_rows(self.tokenizer, scored_batches, sample_scores,
                                                self.typed.trainer.log_val_generations)
        return metrics

    # ---------------------------------------------------------------------------------------------- the loop
    def _step_ends_with(self, step: int) -> tuple[bool, bool]:
        """(validate, save): whether step ``step`` ends with a validation and with a checkpoint."""
        tcfg, last = self.typed.trainer, step >= self.total_training_steps
        return (self.val_dataset is not None and tcfg.test_freq > 0 and (last or step % tcfg.test_freq == 0),
                tcfg.save_freq > 0 and (last or step % tcfg.save_freq == 0))

    def fit(self) -> dict[str, float]:
        """Train until ``total_training_steps``; resume, validate, checkpoint and log along the way.

        Returns the metrics of the last step (with the final validation metrics, if any).
        """
        tcfg = self.typed.trainer
        backends = [name for name in tcfg.logger if name != "console"]  # console: the compact line of log()
        tracking = Tracking(tcfg.project_name, tcfg.experiment_name, default_backend=backends,
                            config=self.config, log_dir=tcfg.log_dir)
        console = setup_console_logger() if "console" in tcfg.logger else None

        def log(metrics: dict[str, float], step: int) -> None:
            tracking.log(metrics, step=step)
            if self._val_generations:
                tracking.log_table("val/generations", ["input", "output", "score"], self._val_generations, step)
                self._val_generations = []
            if console is not None:
                first = self.rollout_loop.console_metrics
                console.info(format_console_line(step, self.total_training_steps, metrics, first))
        threshold = staleness_of(self.typed)
        ahead = RolloutAhead(self.rollouts.train_batch, self.turn_signal.generated) if threshold == 1 else None
        stream = RolloutStream(self.rollouts.train_batch, self.rollout_loop.on_train_step_end, threshold,
                               self.turn_signal.generated, self.rollouts.start_train_batch,
                               in_flight_of(self.typed)) if threshold >= 2 else None

        def boundary(step: int) -> bool:
            """Whether step ``step`` ends with a checkpoint or the run (no rollout in flight across it)."""
            return step >= self.total_training_steps or self._step_ends_with(step)[1]
        try:
            seed = tcfg.seed
            random.seed(seed)
            np.random.seed(seed)
            torch.manual_seed(seed)
            self.load_checkpoint()
            if self.standalone is not None:  # the loaded weights, before any rollout
                self.standalone.sync(self.actor_rollout_wg)
            last_metrics: dict[str, float] = {}
            if tcfg.val_only:  # veRL's trainer.val_only: validate the loaded model and stop
                val_metrics = self.validate()
                log(val_metrics, step=self.global_steps)
                logger.info("trainer.val_only: validated the model at step %d; not training", self.global_steps)
                return val_metrics
            if self.val_dataset is not None and tcfg.val_before_train and self.global_steps == 0:
                if self.total_training_steps > 0 and ahead is not None:  # step 1's rollout runs beside it
                    ahead.start(self._next_prompt_batch(), 1)
                elif self.total_training_steps > 0 and stream is not None:  # and those the bound allows after it
                    stream.fill(min(fill_limit(1, threshold, boundary), threshold), self._next_prompt_batch, 0)
                val_metrics = self.validate()
                log(val_metrics, step=0)
                last_metrics.update(val_metrics)
            if self.global_steps >= self.total_training_steps:
                logger.warning(nothing_to_train(self.global_steps, self.total_training_steps))
            progress = tqdm(total=self.total_training_steps, initial=self.global_steps, desc="training steps")
            while self.global_steps < self.total_training_steps:
                self.global_steps += 1
                last = self.global_steps >= self.total_training_steps
                validate, save = self._step_ends_with(self.global_steps)
                if stream is not None:
                    metrics = self.stream_step(stream, fill_limit(self.global_steps, threshold, boundary))
                elif ahead is None:
                    metrics = self.train_step(self._next_prompt_batch())
                else:  # no rollout in flight across a checkpoint
                    metrics = self.off_policy_step(ahead, overlap_next=not (last or save))
                metrics["training/epoch"] = self.train_loader.epoch
                if validate:
                    metrics.update(self.validate())
                if save:
                    timing: dict[str, float] = {}
                    with timer("save_checkpoint", timing):
                        self.save_checkpoint()
                    metrics["timing_s/save_checkpoint"] = timing["save_checkpoint"]
                log(metrics, step=self.global_steps)
                progress.update(1)
                last_metrics = metrics
            progress.close()
            return last_metrics
        finally:
            if ahead is not None:
                ahead.close()
            if stream is not None:
                stream.close()
            tracking.finish()
