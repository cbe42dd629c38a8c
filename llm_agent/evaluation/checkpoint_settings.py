"""Evaluation settings from the training config of the checkpoint being evaluated.

A checkpoint agent (`global_step_N`, its `actor/`, or a checkpoint root: its latest complete step) brings its
step (`trainer_state.json`'s `global_step`) and the config it was trained with (`trainer_config.json`,
`verl.utils.run_config`). An evaluation setting that the command line leaves unset takes the value the run used
(`SETTING_KEYS`: e.g. `max_turns` is `rollout_loop.config.max_turns`, the test file is `data.val_files`, the
run's validation set), so evaluating a run's checkpoint repeats its validation; settings that neither gives keep
the rollout loop's defaults. Checkpoints of several agents that disagree on an unset setting are an error naming
the setting, since every agent of one evaluation must meet the same users under the same rules.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llm_agent.evaluation.defaults import MAX_PROMPT_LENGTH
from llm_agent.evaluation.local_agents import resolve_model_dir
from verl.utils.checkpoint import load_trainer_state, step_of
from verl.utils.run_config import CONFIG_FILE, RunConfig, load_run_config

logger = logging.getLogger(__name__)

__all__ = ["CheckpointInfo", "SETTING_KEYS", "checkpoint_info", "resolve_settings", "settings_from_checkpoints"]

# evaluation setting (evaluate.py's option without "--", dashes as underscores) -> the training config key
SETTING_KEYS: dict[str, str] = {
    "scenario": "rollout_loop.config.scenario",
    "test_file": "data.val_files",
    "max_prompt_length": "data.max_prompt_length",
    "max_turns": "rollout_loop.config.max_turns",
    "max_tokens_per_turn": "rollout_loop.config.max_tokens_per_turn",
    "max_response_length": "rollout_loop.config.max_response_length",
    "max_user_tokens": "rollout_loop.config.max_user_tokens",
    "seed": "rollout_loop.config.seed",
    "sim_temperature": "rollout_loop.config.user_sim.temperature",
    "sim_top_p": "rollout_loop.config.user_sim.top_p",
    "sim_max_tokens": "rollout_loop.config.user_sim.max_tokens",
    "sim_timeout_s": "rollout_loop.config.user_sim.timeout_s",
    "sim_max_attempts": "rollout_loop.config.user_sim.max_attempts",
}
_PATHS = ("scenario", "test_file")  # relative paths in a run's config are relative to the run's directory


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint agent's `global_step_N` directory, its step and its recorded training config (None for a
    checkpoint written before configs were recorded)."""

    step_dir: Path
    global_step: int
    run_config: RunConfig | None

    def setting(self, name: str) -> Any:
        """The training config's value for evaluation setting `name` (None when it does not record one)."""
        if self.run_config is None:
            return None
        value = self.run_config.select(SETTING_KEYS[name])
        if name == "test_file" and isinstance(value, list):
            value = value[0] if len(value) == 1 else None  # several validation files: no single test file
        if name in _PATHS and isinstance(value, str):
            value = self.run_config.resolve(value)
        return value


def checkpoint_info(spec: str) -> CheckpointInfo | None:
    """The checkpoint behind a local agent spec, None when the spec is a plain model directory (no
    `global_step_N` around its weights); ValueError from `resolve_model_dir` when it is neither."""
    model_dir = resolve_model_dir(spec)
    step_dir = model_dir.parent
    if model_dir.name != "actor":
        return None
    try:
        step = step_of(step_dir)
    except ValueError:
        return None
    try:
        step = int(load_trainer_state(step_dir).get("global_step", step))
    except ValueError as exc:  # a torn trainer state: its directory still names the step
        logger.warning("%s: %s; taking the step from the directory name", step_dir, exc)
    run_config = load_run_config(step_dir)
    if run_config is None:
        logger.warning("%s has no %s (a checkpoint from before training configs were recorded): evaluation "
                       "settings not given on the command line keep their defaults", step_dir, CONFIG_FILE)
    return CheckpointInfo(step_dir=step_dir, global_step=step, run_config=run_config)


def settings_from_checkpoints(given: Mapping[str, Any], checkpoints: Sequence[tuple[str, CheckpointInfo]]
                              ) -> tuple[dict[str, Any], dict[str, str]]:
    """(settings, where each came from): every `SETTING_KEYS` setting that `given` (the command line) leaves None,
    taken from the named checkpoints' configs; a setting no checkpoint records stays None (the caller's default).
    ValueError naming the setting and the agents when their checkpoints disagree."""
    settings, origin = dict(given), {}
    for name, key in SETTING_KEYS.items():
        if given.get(name) is not None:
            origin[name] = "command line"
            continue
        found = {agent: info.setting(name) for agent, info in checkpoints if info.setting(name) is not None}
        if len(set(map(repr, found.values()))) > 1:
            values = ", ".join(f"{agent}: {value!r}" for agent, value in found.items())
            raise ValueError(f"the checkpoints were trained with different {key} ({values}); pass "
                             f"--{name.replace('_', '-')} to choose one for every agent")
        if found:
            agent, value = next(iter(found.items()))
            settings[name] = value
            origin[name] = f"{key} of {agent}'s training config"
    return settings, origin


def resolve_settings(args: Any, checkpoints: list[tuple[str, Any]], need_test_file: bool = True
                     ) -> tuple[dict[str, Any], dict[str, str]]:
    """Every setting: the command line's, else the checkpoints' training config, else the defaults of the rollout
    loop and the simulator client; and where each came from (`args` has every `SETTING_KEYS` attribute)."""
    from llm_agent.rollout.config import GenerationConfig
    from llm_agent.scenario import DEFAULT_SCENARIO_PATH
    from llm_agent.user_sim.client import UserSimConfig

    values, origin = settings_from_checkpoints({name: getattr(args, name) for name in SETTING_KEYS}, checkpoints)
    defaults = {"scenario": str(DEFAULT_SCENARIO_PATH), "max_prompt_length": MAX_PROMPT_LENGTH,
                **{name: getattr(GenerationConfig, name) for name in ("max_turns", "max_tokens_per_turn",
                                                                     "max_response_length", "max_user_tokens", "seed")},
                **{f"sim_{name}": getattr(UserSimConfig, name) for name in ("temperature", "top_p", "max_tokens",
                                                                            "timeout_s", "max_attempts")}}
    for name, value in defaults.items():
        if values.get(name) is None:
            values[name], origin[name] = value, "default"
    if values.get("test_file") is None and need_test_file:
        raise ValueError("no test file: pass --test-file (a checkpoint agent's training config gives its "
                         "data.val_files)")
    return values, origin
