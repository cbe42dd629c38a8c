"""Defaults shared by the evaluation modules and their command lines (`for_evaluation/`).

This module imports nothing, so a command line can build its `--help` from these values without loading numpy,
torch or matplotlib; the modules that use a value import it from here, so each is written once.
"""
from __future__ import annotations

__all__ = ["AGENT_KEY_ENV", "CHECKPOINT", "DEFAULT_BROWSER_LIMIT", "DEFAULT_CONFIDENCE", "DEFAULT_OUTPUTS", "DEFAULT_RESAMPLES", "DEFAULT_SMOOTH",
           "ENGINES", "MAX_PROMPT_LENGTH", "MIN_SMOOTH_POINTS", "SIM_KEY_ENV", "TABLE_FORMATS"]

DEFAULT_RESAMPLES = 1000  # bootstrap resamples of every interval (table, results, report)
DEFAULT_CONFIDENCE = 0.95
DEFAULT_OUTPUTS = "outputs"  # the main.sh output root searched for the latest run
DEFAULT_SMOOTH = 0.6  # EMA weight of the training curves
MIN_SMOOTH_POINTS = 10  # fewer points than this are drawn raw: an EMA over a handful of points mostly lags
DEFAULT_BROWSER_LIMIT = 20_000  # dialogues embedded in the report's browser (about 15 MB of page)
TABLE_FORMATS = ("terminal", "markdown", "csv", "latex")
ENGINES = ("auto", "hf", "vllm")  # how a model or checkpoint agent generates (auto: vllm when installed)
MAX_PROMPT_LENGTH = 4096  # an agent's prompt limit when neither the command line nor a checkpoint gives one
CHECKPOINT = "default: the checkpoint's training config, else "  # help text of the settings a checkpoint gives
AGENT_KEY_ENV = "SEAD_AGENT_API_KEY"  # where an agent endpoint's API key comes from (or a key file)
SIM_KEY_ENV = "SEAD_USER_SIM_API_KEY"  # where the simulators' API key comes from (or a key file)
