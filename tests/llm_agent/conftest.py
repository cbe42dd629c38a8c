"""Fixtures shared by the dialogue-side tests: the tiny model's tokenizer (the scenario is tests/conftest.py's)."""
import pytest
from transformers import AutoTokenizer


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    """The tiny model's tokenizer."""
    return AutoTokenizer.from_pretrained(tiny_model_path)
