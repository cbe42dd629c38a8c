"""Where the scenario files live and which one runs by default: the one definition that modules, scripts and
tests read (`python -m llm_agent.scenario` prints the default for shell scripts).

The scenario YAMLs live beside the trainer's configs (`verl/trainer/config/format_prompt/`, the engine's
`SCENARIO_DIR`, which `format_prompt=<name>` on the trainer's command line also reads), where users edit them and
configs name them; the paths here are absolute, so they hold from any working directory.
"""
from __future__ import annotations

from pathlib import Path

from verl.trainer.cli_overrides import SCENARIO_DIR

__all__ = ["DEFAULT_SCENARIO_NAME", "DEFAULT_SCENARIO_PATH", "SCENARIO_DIR", "SHIPPED_SCENARIO_PATHS",
           "TOKENIZER_SCENARIO_PATHS", "scenario_path"]

DEFAULT_SCENARIO_NAME = "outbound_ad_trial"
"""The scenario the demo, the trainer's config and every command line default to."""

DEFAULT_SCENARIO_PATH = SCENARIO_DIR / f"{DEFAULT_SCENARIO_NAME}.yaml"
"""The default scenario file."""

TOKENIZER_SCENARIO_PATHS = tuple(SCENARIO_DIR / f"{name}.yaml" for name in ("inbound_support", DEFAULT_SCENARIO_NAME))
"""The scenarios whose text every tiny test and demo tokenizer learns (utils/make_tiny_model.py), frozen: a scenario
shipped later is not among them, so shipping one changes no existing tiny model (a run on it passes its file as
`--scenario`, as with a user's own)."""

SHIPPED_SCENARIO_PATHS = (*TOKENIZER_SCENARIO_PATHS, SCENARIO_DIR / "support_desk.yaml")
"""The scenarios the repository ships (a user's new file beside them is not one)."""


def scenario_path(name: str) -> Path:
    """The shipped scenario file called `name` (e.g. "inbound_support")."""
    return SCENARIO_DIR / f"{name}.yaml"
