"""`python -m llm_agent.scenario`: print the default scenario file's path (what shell scripts default `SCENARIO` to)."""
from llm_agent.scenario.paths import DEFAULT_SCENARIO_PATH

print(DEFAULT_SCENARIO_PATH)
