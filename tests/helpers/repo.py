"""The repository root, the default scenario and the CPU demo's compact agent prompt, as the tests use them."""
from __future__ import annotations

from pathlib import Path

from llm_agent.scenario import DEFAULT_SCENARIO_PATH, load_scenario

REPO = Path(__file__).resolve().parents[2]
SCENARIO_PATH = DEFAULT_SCENARIO_PATH
# The demo's short agent system prompt, the scenario's `agent.compact_prompt` (its full one is ~1300 tokens for the
# tiny tokenizer).
COMPACT_SYSTEM_PROMPT = load_scenario(SCENARIO_PATH).agent_compact_prompt
