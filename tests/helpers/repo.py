"""The repository root, the default scenario and the CPU demo's compact agent prompt, as the tests use them."""
from __future__ import annotations

from pathlib import Path

from llm_agent.scenario import DEFAULT_SCENARIO_PATH

REPO = Path(__file__).resolve().parents[2]
SCENARIO_PATH = DEFAULT_SCENARIO_PATH
# The demo's short agent system prompt (the scenario's own is ~1300 tokens for the tiny tokenizer).
COMPACT_SYSTEM_PROMPT = (REPO / "assets" / "compact_agent_prompt.txt").read_text(encoding="utf-8").strip()
