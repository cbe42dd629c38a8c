"""The per-step console line (a plug-in's own metrics first, percentages and grouped values) and the process
logging set-up (third-party libraries at WARNING unless debugging)."""
from __future__ import annotations

import logging

import pytest

from verl.trainer.ppo.metric_utils import format_console_line
from verl.utils.logging_setup import QUIET_LIBRARIES, configure_logging


def test_console_line_shows_a_plugins_metrics_first_with_percentages_and_groups():
    metrics = {"dialogue/completion_rate": 0.4125, "a": 0.2, "b": 0.05, "gen": 12.0, "perf/tokens_per_s": 999.0,
               "timing_s/step": 3.5}
    first = (("dialogue/completion_rate", "CR%"), (("a", "b"), "a/b%"), ("gen", "gen_s"), ("missing", "x"),
             (("a", "missing"), "a/m"))
    line = format_console_line(2, 10, metrics, first)
    assert line == "step 2/10 | CR 41% | a/b 20/5% | gen_s 12 | tok/s 999 | step_s 3.5"


def test_a_plugin_metric_left_out_as_undefined_shows_na_never_zero():
    from llm_agent.generation import LLMGenerationManager

    # every training dialogue of the step failed: the rates over non-error dialogues are undefined (left out)
    metrics = {"dialogue/error_rate": 1.0, "dialogue/n_dialogues": 8.0, "rollout/time_generate_s": 2.0,
               "timing_s/step": 3.0}
    line = format_console_line(5, 10, metrics, LLMGenerationManager.console_metrics)
    assert line.startswith("step 5/10 | CR n/a | done/hang/quit/time/trunc/err n/a/n/a/n/a/n/a/n/a/100% | gen_s 2 |")
    assert "val CR" not in line  # no validation this step: its namespace was not logged, nothing to show
    # an engine metric that is absent (no critic) is still just skipped
    assert "vf_loss" not in format_console_line(1, 2, {"critic/score/mean": 1.0})


def test_the_dialogue_loop_declares_what_people_watch():
    from llm_agent.generation import LLMGenerationManager

    keys = [k for key, _ in LLMGenerationManager.console_metrics for k in (key if isinstance(key, tuple) else (key,))]
    for needed in ("dialogue/completion_rate", "dialogue/hang_up_rate", "rollout/time_generate_s",
                   "rollout/time_user_sim_s", "val/dialogue/completion_rate"):
        assert needed in keys


@pytest.fixture()
def restore_levels():
    saved = {name: logging.getLogger(name).level for name in (*QUIET_LIBRARIES, "")}
    yield
    for name, level in saved.items():
        logging.getLogger(name).setLevel(level)


def test_libraries_are_quiet_by_default_and_loud_when_debugging(restore_levels, monkeypatch):
    monkeypatch.delenv("SEAD_LOG_LEVEL", raising=False)
    logging.getLogger("httpx").setLevel(logging.NOTSET)
    assert configure_logging() == "INFO"
    assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)
    assert logging.getLogger("httpx").isEnabledFor(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.NOTSET)
    monkeypatch.setenv("SEAD_LOG_LEVEL", "debug")
    assert configure_logging() == "DEBUG"
    assert logging.getLogger("httpx").level == logging.NOTSET
