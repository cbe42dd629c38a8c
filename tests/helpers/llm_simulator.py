"""Test helper: the quick recipe's tiny LLM simulator (utils/simulator_sft.py QUICK_RECIPE), made once and kept in
the tests' model cache."""
from __future__ import annotations

from pathlib import Path

from tests.helpers.model_cache import cached_model, producer_key
from tests.helpers.repo import SCENARIO_PATH


def quick_simulator_model() -> Path:
    """The quick recipe's fine-tuned tiny simulator's directory (made on first use)."""
    from utils.simulator_sft import QUICK_RECIPE, tiny_fingerprint, tiny_simulator

    key = producer_key(model="tiny_simulator", fingerprint=tiny_fingerprint(QUICK_RECIPE, SCENARIO_PATH))
    return Path(cached_model("tiny_simulator", key, lambda out: tiny_simulator(out, SCENARIO_PATH, QUICK_RECIPE)))
