"""The optional inputs the trainer hands a registered advantage estimator, by the names of its parameters.

Every estimator gets ``token_level_rewards``, ``response_mask`` and ``config`` (and ``index`` /
``reward_baselines`` when the batch has them). An estimator that names one of :data:`OPTIONAL_INPUTS` among its
own parameters also gets it: the critic's ``values``, the agent-turn numbering ``agent_turn_ids``
(:func:`verl.utils.agent_turns.agent_turn_ids`), the per-turn rewards ``turn_scores``, and the algorithm settings
``gamma``, ``lam`` and ``norm_adv_by_std_in_grpo``. A required parameter whose batch key is missing is a clear
error instead of a ``TypeError``.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from verl.errors import ContractError
from verl.trainer.ppo.turn_layout import TURN_SCORES
from verl.utils.agent_turns import agent_turn_ids

__all__ = ["OPTIONAL_INPUTS", "PLUGIN_INPUTS", "estimator_inputs", "plugin_inputs"]

OPTIONAL_INPUTS = ("values", "agent_turn_ids", TURN_SCORES, "gamma", "lam", "norm_adv_by_std_in_grpo")
# The inputs only a reward or rollout-loop plug-in can write, and what they are.
PLUGIN_INPUTS = {TURN_SCORES: "the per-turn rewards"}


def plugin_inputs(fn: Callable[..., Any], required: bool = True) -> list[str]:
    """The :data:`PLUGIN_INPUTS` estimator ``fn`` takes: those it requires (a parameter without a default), or with
    ``required=False`` every one it accepts."""
    parameters = inspect.signature(fn).parameters
    return [name for name in PLUGIN_INPUTS if name in parameters
            and (not required or parameters[name].default is inspect.Parameter.empty)]


def estimator_inputs(fn: Callable[..., Any], data: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments among :data:`OPTIONAL_INPUTS` that ``fn`` declares, from the DataProto ``data`` and
    ``settings`` (``gamma``, ``lam``, ``norm_adv_by_std_in_grpo``); ContractError naming the estimator when a
    parameter without a default has nothing to take (e.g. ``values`` without a critic)."""
    parameters = inspect.signature(fn).parameters
    keys = data.batch.keys()
    sources: dict[str, Callable[[], Any]] = {
        "values": lambda: data.batch["values"],
        "agent_turn_ids": lambda: agent_turn_ids(data.batch),
        TURN_SCORES: lambda: data.batch[TURN_SCORES],
    }
    available = {"values": "values" in keys, "agent_turn_ids": "response_mask" in keys,
                 TURN_SCORES: TURN_SCORES in keys}
    kwargs: dict[str, Any] = {}
    for name in OPTIONAL_INPUTS:
        parameter = parameters.get(name)
        if parameter is None or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if name in settings:
            kwargs[name] = settings[name]
        elif available[name]:
            kwargs[name] = sources[name]()
        elif parameter.default is inspect.Parameter.empty:
            raise ContractError(f"advantage estimator {getattr(fn, '__name__', fn)!r} needs batch[{name!r}]"
                                + (" (the critic's values: it trains a critic)" if name == "values" else "")
                                + (f" ({PLUGIN_INPUTS[name]}, written by the reward or rollout-loop plug-in: "
                                   "docs/turn_level_credit.md)" if name in PLUGIN_INPUTS else ""))
    return kwargs
