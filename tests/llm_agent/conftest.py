"""Fixtures shared by the rollout-loop tests: the tiny model's tokenizer and the outbound scenario."""
import pytest
from transformers import AutoTokenizer

from llm_agent.scenario import DEFAULT_SCENARIO_PATH, load_scenario


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    """The tiny model's tokenizer."""
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def scenario():
    """The outbound advertising-trial scenario."""
    return load_scenario(DEFAULT_SCENARIO_PATH)
