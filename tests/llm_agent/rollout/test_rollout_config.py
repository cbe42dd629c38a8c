"""GenerationConfig: a per-dialogue budget that cannot fit `max_turns` turns is a config error."""
import logging
from pathlib import Path

import pytest

from llm_agent.rollout.config import ConfigError, GenerationConfig, MIN_AGENT_TURN_TOKENS, MIN_USER_TURN_TOKENS
from llm_agent.rollout.dialogue import ChatMarkers
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


def test_budget_that_fits_only_short_turns_is_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="llm_agent.rollout.config"):
        GenerationConfig.from_dict(config())  # 4 x (96 + 128 + 10) = 936 > 512
    assert any("fits 2 of the 4 turns at their limits" in r.getMessage() for r in caplog.records), caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llm_agent.rollout.config"):
        GenerationConfig.from_dict(config(max_turns=15, max_tokens_per_turn=256, max_response_length=6144))
    assert not caplog.records, "the GPU preset's budget fits 15 turns at their limits"


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: Path(p).stem)
def test_constants_are_below_real_minimal_turns(tok, path):
    """The rule must never reject a budget that real short turns fit: measure them with a real tokenizer."""
    scenario = load_scenario(path)
    text = scenario.format_agent_output("Hi.", 0, 0, {"cooperation": 2, "emotion": 2, "trust": 2})
    agent_turn = len(tok.encode(text, add_special_tokens=False)) + 1  # + the end-of-turn token
    user_turn = len(ChatMarkers.from_tokenizer(tok, tok.eos_token_id).user_block(
        tok.encode("Okay.", add_special_tokens=False)))
    assert agent_turn >= MIN_AGENT_TURN_TOKENS and user_turn >= MIN_USER_TURN_TOKENS, (agent_turn, user_turn)

