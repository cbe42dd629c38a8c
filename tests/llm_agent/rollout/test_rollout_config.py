"""GenerationConfig: a per-dialogue budget that cannot fit `max_turns` turns is a config error; NaN/inf, non-http
simulator URLs, wrong types and unknown keys are config errors naming the full key."""
import logging
import math
import re
from pathlib import Path

import pytest

from llm_agent.rollout.config import ConfigError, GenerationConfig, MIN_AGENT_TURN_TOKENS, MIN_USER_TURN_TOKENS
from llm_agent.envs import ChatMarkers
from llm_agent.scenario import SCENARIO_DIR, load_scenario

from tests.helpers.repo import SCENARIO_PATH

SCENARIOS = sorted(SCENARIO_DIR.glob("*.yaml"))


def config(**overrides):
    cfg = {"scenario": str(SCENARIO_PATH), "max_turns": 4, "max_tokens_per_turn": 96,
           "max_response_length": 512, "max_user_tokens": 128, "cache": {"enabled": False}}
    cfg.update(overrides)
    return cfg


@pytest.mark.parametrize("turns, per_turn, smallest", [
    (4, 96, 4 * (48 + 10)),   # the CPU demo's shape: each turn needs a 48-token agent turn and a 10-token user turn
    (15, 256, 15 * (48 + 10)),
    (3, 12, 3 * (12 + 10)),   # an agent turn can never exceed max_tokens_per_turn
])
def test_budget_must_fit_max_turns_minimal_turns(turns, per_turn, smallest):
    ok = GenerationConfig.from_dict(config(max_turns=turns, max_tokens_per_turn=per_turn,
                                           max_response_length=smallest))
    assert ok.max_response_length == smallest
    with pytest.raises(ConfigError) as err:
        GenerationConfig.from_dict(config(max_turns=turns, max_tokens_per_turn=per_turn,
                                          max_response_length=smallest - 1))
    message = str(err.value)
    assert f"rollout_loop.config.max_response_length ({smallest - 1}) cannot fit" in message
    assert f"rollout_loop.config.max_turns ({turns}) turns" in message
    assert f"must be >= {smallest}" in message and "data.max_response_length" in message


def test_the_old_truncation_test_shape_is_rejected():
    # 5 turns of at most 64 agent tokens in 200 tokens: at most 2 or 3 short turns fit
    with pytest.raises(ConfigError, match=r"cannot fit rollout_loop\.config\.max_turns \(5\) turns"):
        GenerationConfig.from_dict(config(max_turns=5, max_tokens_per_turn=64, max_response_length=200))


def test_budget_that_fits_only_short_turns_is_a_warning_printed_once(caplog):
    with caplog.at_level(logging.WARNING, logger="llm_agent.rollout.config"):
        GenerationConfig.from_dict(config(max_response_length=517))  # 4 x (96 + 128 + 10) = 936 > 517
    assert any("(517) fits 2 of the 4 turns at their limits" in r.getMessage() for r in caplog.records), caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llm_agent.rollout.config"):
        GenerationConfig.from_dict(config(max_response_length=517))  # the validation loop's copy of the config
    assert not caplog.records, "the same settings warned twice"
    with caplog.at_level(logging.WARNING, logger="llm_agent.rollout.config"):
        GenerationConfig.from_dict(config(max_turns=15, max_tokens_per_turn=256, max_response_length=6144))
    assert not caplog.records, "the GPU preset's budget fits 15 turns at their limits"


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: Path(p).stem)
def test_constants_are_below_real_minimal_turns(tok, path):
    """The rule must never reject a budget that real short turns fit: measure them with a real tokenizer."""
    scenario = load_scenario(path)
    text = scenario.format_agent_output("Hi.", 0, 0, dict.fromkeys(scenario.dims, 2))
    agent_turn = len(tok.encode(text, add_special_tokens=False)) + 1  # + the end-of-turn token
    user_turn = len(ChatMarkers.from_tokenizer(tok, tok.eos_token_id).user_block(
        tok.encode("Okay.", add_special_tokens=False)))
    assert agent_turn >= MIN_AGENT_TURN_TOKENS and user_turn >= MIN_USER_TURN_TOKENS, (agent_turn, user_turn)



def _nested(key: str, value):
    """{"a": {"b": value}} for key "a.b"."""
    head, _, rest = key.partition(".")
    return {head: _nested(rest, value) if rest else value}


@pytest.mark.parametrize("key", ["user_sim.timeout_s", "user_sim.deadline_s", "user_sim.temperature", "user_sim.top_p",
                                 "user_sim.max_error_rate", "async_rollout.batch_wait_ms", "cache.default_hit_rate",
                                 "controller.target_completion_rate", "controller.dead_band", "controller.smoothing",
                                 "controller.floor"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_numbers_are_rejected_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=rf"^rollout_loop\.config\.{re.escape(key)}"):
        GenerationConfig.from_dict(config(**_nested(key, value)))


def test_nan_is_rejected_where_inf_means_no_limit():
    assert GenerationConfig.from_dict(config(controller={"max_ratio": float("inf")})).controller.max_ratio == math.inf
    with pytest.raises(ConfigError, match=r"rollout_loop\.config\.controller\.max_ratio must be a number \(not NaN\)"):
        GenerationConfig.from_dict(config(controller={"max_ratio": float("nan")}))
    with pytest.raises(ConfigError, match=r"rollout_loop\.config\.cache\.stage_hit_rates\[0\] must be a finite"):
        GenerationConfig.from_dict(config(cache={"stage_hit_rates": {0: float("nan")}}))


@pytest.mark.parametrize("urls", ["ftp://127.0.0.1:5000", "127.0.0.1:5000", "file:///etc/passwd",
                                  ["http://127.0.0.1:5000", "javascript:alert(1)"], "http://a:1,http://a:1/v1"])
def test_simulator_urls_must_be_distinct_http_urls(urls):
    with pytest.raises(ConfigError, match=r"^rollout_loop\.config\.user_sim\.urls: user-simulator url #\d"):
        GenerationConfig.from_dict(config(user_sim={"urls": urls}))


def test_simulator_urls_are_normalised():
    parsed = GenerationConfig.from_dict(config(user_sim={"urls": " http://a:1/v1/, https://b:2 ,"}))
    assert parsed.user_sim.urls == ["http://a:1", "https://b:2"]
    assert GenerationConfig.from_dict(config(user_sim={"urls": ""})).user_sim.urls is None


def test_api_key_is_kept_out_of_the_config_repr():
    parsed = GenerationConfig.from_dict(config(user_sim={"api_key": "sk-secret-123"}))
    assert parsed.user_sim.api_key == "sk-secret-123" and "sk-secret-123" not in repr(parsed)


@pytest.mark.parametrize("override, match", [
    ({"max_turns": 3.0}, r"rollout_loop\.config\.max_turns must be an integer, got 3\.0"),
    ({"mode": "asynchronous"}, r"rollout_loop\.config\.mode must be one of \['sync', 'async'\]"),
    ({"user_sim": {"check_at_start": "yes"}}, r"rollout_loop\.config\.user_sim\.check_at_start must be true or false"),
    ({"cache": {"enabled": 1}}, r"rollout_loop\.config\.cache\.enabled must be true or false"),
    ({"controller": {"flor": 0.1}}, r"rollout_loop\.config\.controller\.flor is not a config key \(did you mean "
                                    r"rollout_loop\.config\.controller\.floor\?\)"),
    ({"user_sim": []}, r"rollout_loop\.config\.user_sim must be a mapping"),
])
def test_types_and_keys_are_checked_by_the_engine_coercer(override, match):
    with pytest.raises(ConfigError, match=match):
        GenerationConfig.from_dict(config(**override))


def test_the_dialogue_config_error_is_the_engine_one():
    from verl.trainer.config_schema import ConfigError as EngineConfigError

    assert ConfigError is EngineConfigError
