"""Command-line overrides, checked before Hydra composes the config.

Hydra rejects a plain override of a key that does not exist (`trainer.total_trainng_steps=3`) with its own
message, while an unknown `+key` reaches the config check and gets a "did you mean". This module gives both the
same clear error. It also turns `format_prompt=<name>` (or Hydra's own suggestion, `+format_prompt=<name>`) into
`rollout_loop.config.scenario=<config dir>/format_prompt/<name>.yaml`: the scenario YAMLs live in that
directory, which Hydra would otherwise load as a config group and fail on their `${...}` placeholders. And it
expands `preset=<name>` into that preset's keys (verl/trainer/config/preset/<name>.yaml, resolved by
verl/trainer/presets.py), under the other key=value arguments, which win.
"""
from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

from verl.trainer.config_schema import CONFIG_DIR, CONFIG_NAME, ConfigError

__all__ = ["SCENARIO_DIR", "check_overrides", "config_name_from_argv", "expand_preset"]

SCENARIO_DIR = CONFIG_DIR / "format_prompt"
SCENARIO_KEY = "rollout_loop.config.scenario"


def config_name_from_argv(argv: Sequence[str]) -> str:
    """The `--config-name` / `-cn` given on the command line (either `--config-name X` or `--config-name=X`)."""
    for i, arg in enumerate(argv):
        for flag in ("--config-name", "-cn"):
            if arg == flag and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    return CONFIG_NAME


def _override_positions(argv: Sequence[str]) -> list[int]:
    """Indices of the `key=value` overrides in argv (not flags, not a flag's value)."""
    takes_value = {"--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd", "--info", "-i"}
    positions, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg in takes_value:
            skip = True
        elif not arg.startswith("-") and "=" in arg:
            positions.append(i)
    return positions


def _scenario_override(name: str) -> str:
    """`rollout_loop.config.scenario=<path>` for a scenario name; ConfigError listing the ones that exist."""
    path = SCENARIO_DIR / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in SCENARIO_DIR.glob("*.yaml"))
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"format_prompt={name}: no scenario {path}{hint}; scenarios: {', '.join(known)}")
    return f"{SCENARIO_KEY}={path}"


def _missing_key_error(base: Mapping[str, Any], key: str) -> str | None:
    """None when the dotted `key` exists in `base`, else the error text with the closest existing key."""
    node: Any = base
    walked: list[str] = []
    for part in key.split("."):
        if not isinstance(node, Mapping):
            return None  # below a leaf or a list: Hydra and the config check decide
        if part not in node:
            close = difflib.get_close_matches(part, [str(k) for k in node], n=1)
            where = ".".join(walked)
            hint = f" (did you mean {where + '.' if where else ''}{close[0]}?)" if close else ""
            return f"unknown key {key}{hint}"
        node = node[part]
        walked.append(part)
    return None


def expand_preset(argv: Sequence[str]) -> tuple[list[str], str | None, dict[str, Any] | None]:
    """(argv with `preset=<name>` replaced by the preset's resolved keys and the other key=value arguments over
    them, the preset's name, every resolved Setting by key); argv unchanged and None, None without a preset."""
    out = list(argv)
    positions = _override_positions(out)
    named = [i for i in positions if out[i].split("=", 1)[0].lstrip("+") == "preset"]
    if not named:
        return out, None, None
    if len(named) > 1:
        raise ConfigError("preset= is given more than once")
    from verl.trainer.presets import resolve, trainer_overrides

    name = out[named[0]].split("=", 1)[1]
    others = [out[i] for i in positions if i != named[0]]
    settings = resolve(name, [("command line", others)], config_name_from_argv(out))
    flags = [arg for i, arg in enumerate(out) if i not in set(positions)]
    return flags + trainer_overrides(settings), name, settings


def check_overrides(argv: Sequence[str], base: Mapping[str, Any] | None = None) -> list[str]:
    """argv with `format_prompt=<name>` rewritten to the scenario path; ConfigError for a plain override of a key
    that is not in the config (`base`: the composed config as plain containers, composed here when None), and
    `preset=<name>` expanded (expand_preset)."""
    out = list(argv)
    for i in _override_positions(out):  # the scenario first: a preset's {scenario} is its name
        key, value = out[i].split("=", 1)
        if key.lstrip("+") == "format_prompt":
            out[i] = _scenario_override(value)
    out = expand_preset(out)[0]
    positions = _override_positions(out)
    if not positions:
        return out
    if base is None:
        from omegaconf import OmegaConf

        from verl.trainer.config_schema import compose_config

        base = OmegaConf.to_container(compose_config([], config_name_from_argv(out)), resolve=False)
    for i in positions:
        key = out[i].split("=", 1)[0]
        bare = key.lstrip("+~")
        if not key.startswith(("+", "~")) and not bare.startswith("hydra."):
            error = _missing_key_error(base, bare)
            if error is not None:
                raise ConfigError(error)
    return out

