"""Training presets: YAML groups of trainer keys (verl/trainer/config/preset/NAME.yaml) composed over the base config.

A preset is a flat mapping of command-line keys to values, written as on the command line (every scalar is read as
text, so `1e-6` stays `1e-6`). Two keys are directives: `inherits: NAME` (start from that preset's values) and
`recipe: MODULE` (add `MODULE.RECIPE.preset_values()`: the CPU preset's learning values live in
utils/cpu_recipe.py only). Keys under `launch.` are scripts/main.sh's (prompt-data sizes, the trainer's GPUs, the
seed of every process), not the trainer's. In a value, `${key}` stands for another key's resolved value (else the
base config's), `{model}` for the model directory's name, `{scenario}` for the scenario file's stem, `{engine}` for
vllm when this Python can import vLLM (else hf) and `{experiment}` for trainer.experiment_name.

The order, last wins: the base YAML (sead_trainer.yaml) <- the preset (its parent first) <- the launcher's keys
(scripts/main.sh: paths, the model, the simulators) <- key=value arguments. Every resolved value keeps its origin
(`preset gpu`, `scripts/main.sh`, `command line`, ...) and the value it replaced, for the dry run.
"""
from __future__ import annotations

import importlib
import importlib.util
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from verl.trainer.config_schema import CONFIG_DIR, ConfigError

__all__ = ["PRESET_DIR", "SEED_KEYS", "Setting", "preset_args", "preset_names", "preset_settings", "resolve",
           "trainer_overrides"]

PRESET_DIR = CONFIG_DIR / "preset"
LAUNCH = "launch."
# The trainer's seeds that launch.seed sets (with the prompt data's, the simulators' and the warm start's).
SEED_KEYS = ("data.seed", "actor_rollout_ref.actor.seed", "trainer.seed", "rollout_loop.config.seed",
             "rollout_loop.config.controller.seed")
MODEL_KEY = "actor_rollout_ref.model.path"
SCENARIO_KEY = "rollout_loop.config.scenario"
EXPERIMENT_KEY = "trainer.experiment_name"
_REFERENCE = re.compile(r"\$\{([A-Za-z0-9_.]+)\}")


@dataclass(frozen=True)
class Setting:
    """One resolved value, where it came from and the setting it replaced (None: it replaced a base default)."""

    value: str
    origin: str
    replaced: Optional["Setting"] = None

    def over(self, earlier: Optional["Setting"]) -> "Setting":
        """This setting replacing `earlier`."""
        return Setting(self.value, self.origin, earlier)


def preset_names() -> list[str]:
    """The presets that exist (the YAML files' stems)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def _read(name: str) -> dict[str, Any]:
    path = PRESET_DIR / f"{name}.yaml"
    if name not in preset_names():  # a name, never a path (PRESET=../x)
        raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(preset_names())} ({PRESET_DIR})")
    raw = yaml.load(path.read_text(encoding="utf-8"), Loader=yaml.BaseLoader) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a preset is a mapping of keys to values")
    for key, value in raw.items():
        if not isinstance(value, str):
            raise ConfigError(f"{path}: {key} must be one value as on the command line (quote a list or mapping: "
                              f"\"[a,b]\"), got {value!r}")
    return raw


def preset_settings(name: str, _seen: tuple[str, ...] = ()) -> dict[str, Setting]:
    """The preset's own and inherited keys -> Setting (origin `preset NAME`), in file order, parents first."""
    if name in _seen:
        raise ConfigError(f"preset {name!r} inherits itself: {' -> '.join((*_seen, name))}")
    raw = _read(name)
    settings: dict[str, Setting] = {}
    parent = raw.pop("inherits", None)
    if parent:
        settings.update(preset_settings(parent, (*_seen, name)))
    recipe = raw.pop("recipe", None)
    if recipe:
        values = importlib.import_module(recipe).RECIPE.preset_values()
        overlap = sorted(set(values) & set(raw))
        if overlap:
            raise ConfigError(f"preset {name!r} sets {', '.join(overlap)}, which its recipe {recipe} sets: one "
                              f"source per value")
        for key, value in values.items():
            settings[key] = Setting(value, f"preset {name} ({recipe})").over(settings.get(key))
    for key, value in raw.items():
        settings[key] = Setting(value, f"preset {name}").over(settings.get(key))
    return settings


def preset_args(name: str, keys: Iterable[str]) -> tuple[str, ...]:
    """`key=value` of the preset's resolved value of each key (for what runs part of a preset: no copy)."""
    settings = resolve(name)
    missing = [key for key in keys if key not in settings]
    if missing:
        raise ConfigError(f"preset {name!r} sets no {', '.join(missing)}")
    return tuple(f"{key}={settings[key].value}" for key in keys)


def _layer(settings: dict[str, Setting], origin: str, args: Iterable[str]) -> None:
    for arg in args:
        if "=" not in arg:
            raise ConfigError(f"{arg!r} ({origin}) is not key=value")
        key, value = arg.split("=", 1)
        settings[key] = Setting(value, origin).over(settings.get(key))


class _Base:
    """The base config (`config_name`.yaml with no overrides), composed on first use only."""

    def __init__(self, config_name: str):
        self.config_name, self._config = config_name, None

    def value(self, key: str) -> Optional[str]:
        from omegaconf import OmegaConf

        from verl.trainer.config_schema import compose_config

        if self._config is None:
            self._config = compose_config([], config_name=self.config_name)
        value = OmegaConf.select(self._config, key, default=None, throw_on_resolution_failure=False)
        return None if value is None else str(value)


def _substitute(settings: dict[str, Setting], base: _Base) -> None:
    """Resolve `${key}` references, then the `{model}`, `{scenario}`, `{engine}` and `{experiment}` names."""

    def value_of(key: str, chain: tuple[str, ...]) -> str:
        if key in chain:
            raise ConfigError(f"the values of {' -> '.join((*chain, key))} refer to each other")
        if key in settings:
            return resolved(key, chain + (key,))
        found = base.value(key)
        if found is None:
            raise ConfigError(f"${{{key}}} ({chain[-1] if chain else '?'}) names no key that is set")
        return found

    def resolved(key: str, chain: tuple[str, ...]) -> str:
        return _REFERENCE.sub(lambda m: value_of(m.group(1), chain), settings[key].value)

    for key in list(settings):
        new = resolved(key, (key,))
        settings[key] = Setting(new, settings[key].origin, settings[key].replaced)
    names = {"{model}": Path(settings[MODEL_KEY].value if MODEL_KEY in settings else
                             base.value(MODEL_KEY) or "model").name,
             "{scenario}": Path(settings[SCENARIO_KEY].value if SCENARIO_KEY in settings else
                                base.value(SCENARIO_KEY) or "scenario").stem,
             "{engine}": "vllm" if importlib.util.find_spec("vllm") is not None else "hf"}

    def named(setting: Optional[Setting]) -> Optional[Setting]:  # the names in it and in what it replaced
        if setting is None:
            return None
        value = setting.value
        for name, text in names.items():
            value = value.replace(name, text)
        return Setting(value, setting.origin, named(setting.replaced))

    if EXPERIMENT_KEY in settings:
        settings[EXPERIMENT_KEY] = named(settings[EXPERIMENT_KEY])
        names["{experiment}"] = settings[EXPERIMENT_KEY].value
    for key in settings:
        settings[key] = named(settings[key])


ROLLOUT_GPUS = "actor_rollout_ref.rollout.n_gpus_per_node"  # the rollout's own GPUs (split placement)


def _derive_launch(settings: dict[str, Setting]) -> None:
    """launch.* nulls that follow other keys, and launch.seed spread over the trainer's seeds."""

    def number(key: str) -> int:
        value = settings[key].value if key in settings else None
        if value is None or not value.isdigit():
            raise ConfigError(f"{key} must be a number of the preset or the command line, got {value!r}")
        return int(value)

    samples = settings.get("launch.train_samples")
    if samples is not None and samples.value == "null":
        derived = number("data.train_batch_size") * number("trainer.total_training_steps")
        settings["launch.train_samples"] = Setting(str(derived), f"{samples.origin}: data.train_batch_size x "
                                                   f"trainer.total_training_steps")
    gpus = settings.get("launch.policy_gpus")
    if gpus is not None and gpus.value == "null":
        count = number("trainer.n_gpus_per_node") + (number(ROLLOUT_GPUS) if ROLLOUT_GPUS in settings else 0)
        derived = ",".join(str(i) for i in range(count))
        settings["launch.policy_gpus"] = Setting(derived, f"{gpus.origin}: 0 .. trainer.n_gpus_per_node"
                                                 + (f" + {ROLLOUT_GPUS}" if ROLLOUT_GPUS in settings else "") + " - 1")
    seed = settings.get("launch.seed")
    if seed is not None and seed.value != "null":
        for key in SEED_KEYS:
            if key not in settings or settings[key].origin.startswith("preset "):
                settings[key] = Setting(seed.value, f"launch.seed ({seed.origin})").over(settings.get(key))


def resolve(preset: Optional[str], layers: Sequence[tuple[str, Sequence[str]]] = (),
            config_name: str = "sead_trainer") -> dict[str, Setting]:
    """Every key the preset and the `layers` ((origin, key=value arguments), later ones win) set -> its Setting,
    resolved (`${key}` of a key nobody set: `config_name`.yaml's value)."""
    settings = preset_settings(preset) if preset else {}
    for origin, args in layers:
        _layer(settings, origin, args)
    _substitute(settings, _Base(config_name))
    _derive_launch(settings)
    return settings


def trainer_overrides(settings: Mapping[str, Setting]) -> list[str]:
    """The trainer's key=value arguments of resolved settings (the launch.* keys are the launcher's)."""
    return [f"{key}={s.value}" for key, s in settings.items() if not key.startswith(LAUNCH)]
