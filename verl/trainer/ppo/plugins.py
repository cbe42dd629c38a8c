"""The trainer's plug-in contracts: the rollout loop (``rollout_loop.path``) and the reward (``reward.path``).

A rollout loop is a subclass of :class:`RolloutLoop` that generates through a
:class:`~verl.workers.rollout.engine.RolloutEngine` (the trainer's: the actor worker group,
:class:`~verl.workers.rollout.replicas.WorkerGroupEngine`): one required method, ``run_llm_loop``, and hooks with
no-op defaults that the trainer calls at fixed points of a run (after each training step, after validation, at
checkpoint save and load, at shutdown). The engine's own default, plain single-turn generation, is
:class:`SingleTurnRollout`. A reward plug-in is any callable of the :class:`RewardFunction` shape; the trainer
binds its ``reward.kwargs`` once at start (:func:`bind_reward`), so a keyword the function does not take fails
before any worker starts. The engine never imports a plug-in's package: both are named by dotted path.

What a plug-in writes into the batch beyond the required tensors (e.g. the per-turn rewards ``turn_scores`` a
turn-level estimator needs) it declares as :class:`BatchOutputs`: a reward function with :func:`declare_outputs`,
a rollout loop by overriding :meth:`RolloutLoop.batch_outputs`; the config check at load
(:mod:`verl.trainer.config_dependencies`) asks them, so a missing input is named, with the key to set, before
anything starts.
"""
from __future__ import annotations

import abc
import importlib
import inspect
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional, Protocol, TypeVar, Union

import torch

from verl.protocol import DataProto
from verl.trainer.config_schema import ConfigError
from verl.workers.rollout.engine import RolloutEngine

__all__ = ["BatchOutputs", "ConsoleMetric", "RewardFunction", "RolloutLoop", "SingleTurnRollout", "bind_reward",
           "declare_outputs", "declared_outputs", "import_dotted", "rollout_loop_class"]

# One entry of the per-step console line: a metric name (or several, shown joined by "/") and its label.
ConsoleMetric = tuple[Union[str, tuple[str, ...]], str]
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class BatchOutputs:
    """The optional batch entries a plug-in writes under its settings (``written``: ``batch`` or
    ``non_tensor_batch`` keys such as ``turn_scores``, ``turn_labels``), and for an entry it writes only under other
    settings, the sentence naming the key to set (``enabled_by``)."""

    written: frozenset[str] = frozenset()
    enabled_by: Mapping[str, str] = field(default_factory=dict)


def declare_outputs(outputs: Callable[[Mapping[str, Any]], BatchOutputs]) -> Callable[[F], F]:
    """Decorator of a reward function: ``outputs(reward.kwargs)`` is what it writes with those keyword arguments
    (it may raise ValueError for a bad one: reported as a config error naming ``reward.kwargs``)."""
    def mark(fn: F) -> F:
        fn.batch_outputs = outputs  # type: ignore[attr-defined]
        return fn
    return mark


def import_dotted(path: str, key: str) -> Any:
    """Import ``module.attr`` named by config key ``key``; errors name the key and what failed."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"{key}={path!r} must be a dotted path module.name")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"{key}={path!r}: cannot import module {module_name!r}: {exc}") from exc
    if not hasattr(module, attr):
        raise AttributeError(f"{key}={path!r}: module {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)


class RolloutLoop(abc.ABC):
    """Turns a generation batch into rollouts; the trainer builds two (training and validation) per run.

    Constructed as ``cls(tokenizer=..., engine=<a RolloutEngine>, config=<rollout_loop.config mapping>,
    is_validation=bool)``; a constructor given anything but a ``RolloutEngine`` raises TypeError. ``run_llm_loop`` gets
    left-padded prompts (``input_ids``, ``attention_mask``,
    ``position_ids``), the rows' ``non_tensor_batch`` (``uid`` and the dataset's extra columns) and the decoding
    ``meta_info``, and returns the generation-batch tensors (``prompts, responses, input_ids, attention_mask,
    position_ids``, optionally ``response_mask``) plus any per-row ``non_tensor_batch`` of its own; metrics it puts
    in the output's ``meta_info["metrics"]`` are logged with the step (under ``val/`` for validation). With
    ``algorithm.filter_groups`` it is called several times in one step, each call a complete generation.
    """

    # The metrics the per-step console line shows first, as (name or names, label) pairs.
    console_metrics: ClassVar[Sequence[ConsoleMetric]] = ()

    def __init__(self, tokenizer: Any, engine: RolloutEngine, config: Mapping[str, Any], is_validation: bool) -> None:
        if not isinstance(engine, RolloutEngine):
            raise TypeError(f"{type(self).__name__} generates through a verl.workers.rollout.engine.RolloutEngine, "
                            f"got {type(engine).__name__}")
        self.tokenizer = tokenizer
        self.engine = engine
        self.is_validation = bool(is_validation)

    @abc.abstractmethod
    def run_llm_loop(self, gen_batch: DataProto) -> DataProto:
        """Generate for every row of ``gen_batch``; one output row per input row, in order."""

    def start_llm_loop(self, gen_batch: DataProto) -> Callable[[], DataProto]:
        """Several training rollouts in flight at once (``async_training.rollouts_in_flight > 1``): do now, on the
        calling thread, everything of ``run_llm_loop`` that depends on the order of the calls (the users drawn,
        the seeds, the call count) and return what runs the dialogues, ``run_llm_loop``'s result, callable from
        another thread while other such calls run. Their outcomes reach the end-of-step hook through the batch it
        gets (no sampled dialogue is left out of it in that mode). NotImplementedError: the loop supports one
        rollout at a time (the trainer refuses the setting at start)."""
        raise NotImplementedError(f"{type(self).__name__} runs one rollout at a time (it does not implement "
                                  "start_llm_loop): set async_training.rollouts_in_flight=1")

    def state_dict(self) -> Mapping[str, Any] | None:
        """JSON-ready state the trainer keeps in ``trainer_state.json`` (None: nothing to keep)."""
        return None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (called on resume when the checkpoint holds a state)."""

    def on_train_step_end(self, batch: DataProto, step: int) -> dict[str, float]:
        """After a step's updates, with the balanced and scored batch the step trained on; returns metrics. In
        one-step-off training (``async_training.staleness_threshold=1``) it is called before the updates instead,
        with the scored batch as the rollout returned it, before the next step's rollout starts
        (docs/off_policy.md)."""
        return {}

    def on_validation_end(self, batches: Sequence[DataProto], step: int) -> dict[str, float]:
        """After validation, with its scored batches; returns metrics (the trainer logs them under ``val/``)."""
        return {}

    def save_checkpoint(self, directory: str | os.PathLike) -> None:
        """Write files of the loop's own into a checkpoint's ``rollout_loop/`` directory."""

    def load_checkpoint(self, directory: str | os.PathLike) -> None:
        """Restore from a checkpoint's ``rollout_loop/`` directory (which may not exist)."""

    def close(self) -> None:
        """Release what the loop holds (clients, files); called once at shutdown."""

    @classmethod
    def batch_outputs(cls, config: Mapping[str, Any]) -> Optional[BatchOutputs]:
        """The optional batch entries the loop writes with ``rollout_loop.config`` ``config`` (None: undeclared,
        so the config check cannot tell)."""
        return None


class SingleTurnRollout(RolloutLoop):
    """The default (``rollout_loop.path: null``): one ``generate_sequences`` call of the engine per batch."""

    @classmethod
    def batch_outputs(cls, config: Mapping[str, Any]) -> BatchOutputs:
        """None of the optional entries."""
        return BatchOutputs()

    def run_llm_loop(self, gen_batch: DataProto) -> DataProto:
        """The engine's single-turn generation of the prompts (per-row non-tensor data stays here)."""
        return self.engine.generate_sequences(DataProto(batch=gen_batch.batch, meta_info=dict(gen_batch.meta_info)))

    def start_llm_loop(self, gen_batch: DataProto) -> Callable[[], DataProto]:
        """The same generation, run by the returned callable (nothing here depends on the order of the calls)."""
        return lambda: self.run_llm_loop(gen_batch)


class RewardFunction(Protocol):
    """``reward.path``: scores a generated batch.

    Returns a float (bs, R) tensor with each row's reward on its last loss-carrying response token, and metrics
    (logged under ``reward/``). It may add per-row entries to ``data.non_tensor_batch``. ``kwargs`` are
    ``reward.kwargs``.
    """

    def __call__(self, data: DataProto, tokenizer: Any, **kwargs: Any) -> tuple[torch.Tensor, dict[str, float]]:
        ...


def bind_reward(fn: RewardFunction, tokenizer: Any, kwargs: Mapping[str, Any],
                path: str = "reward.path") -> Callable[[DataProto], tuple[torch.Tensor, dict[str, float]]]:
    """``data -> fn(data, tokenizer, **kwargs)``, checked: a keyword ``fn`` does not take is a ConfigError naming
    ``reward.kwargs.<key>`` now, and a result that is not a (float (bs, R) tensor, metrics dict) pair fails when
    it comes back, naming ``path``."""
    if not callable(fn):
        raise ConfigError(f"{path} must name a callable, got {type(fn).__name__}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: checked when called
        signature = None
    if signature is not None:
        try:
            signature.bind(None, tokenizer, **kwargs)
        except TypeError as exc:
            params = signature.parameters
            takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
            unknown = [k for k in kwargs if k not in params and not takes_any]
            key = f"reward.kwargs.{unknown[0]}" if unknown else "reward.kwargs"
            raise ConfigError(f"{key}: {path} cannot be called as fn(data, tokenizer, **reward.kwargs): {exc}") \
                from None
    bound = dict(kwargs)

    def reward(data: DataProto) -> tuple[torch.Tensor, dict[str, float]]:
        result = fn(data, tokenizer, **bound)
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.Tensor)
                and isinstance(result[1], Mapping)):
            raise TypeError(f"{path} must return (reward tensor, metrics dict), got {type(result).__name__}")
        scores = result[0]
        if data.batch is not None and "responses" in data.batch.keys() and \
                scores.shape != data.batch["responses"].shape:
            raise ValueError(f"{path} returned rewards of shape {tuple(scores.shape)}; expected the responses' "
                             f"{tuple(data.batch['responses'].shape)}")
        return result[0], dict(result[1])

    return reward


def declared_outputs(plugin: Any, settings: Mapping[str, Any]) -> Optional[BatchOutputs]:
    """What a reward function (:func:`declare_outputs`) or a rollout-loop class (:meth:`RolloutLoop.batch_outputs`)
    declares it writes under ``settings``; None when it declares nothing."""
    if isinstance(plugin, type) and issubclass(plugin, RolloutLoop):
        return plugin.batch_outputs(settings)
    outputs = getattr(plugin, "batch_outputs", None)
    return outputs(settings) if callable(outputs) else None


def rollout_loop_class(path: str) -> type[RolloutLoop]:
    """The ``rollout_loop.path`` class (empty: single-turn generation); TypeError when it is not a RolloutLoop."""
    if not path:
        return SingleTurnRollout
    loop_cls = import_dotted(path, "rollout_loop.path")
    if not (isinstance(loop_cls, type) and issubclass(loop_cls, RolloutLoop)):
        raise TypeError(f"rollout_loop.path={path!r} must name a subclass of "
                        f"verl.trainer.ppo.plugins.RolloutLoop, got {loop_cls!r}")
    return loop_cls
