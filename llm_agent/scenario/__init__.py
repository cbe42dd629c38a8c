"""Scenarios: one `format_prompt/<name>.yaml` loaded, validated, rendered into both sides' prompts and parsed.

The public API is re-exported here (`from llm_agent.scenario import load_scenario, Scenario, UserProfile`):
`scenario.py` holds `Scenario` and `load_scenario`, `types.py` the dataclasses and constants, `loading.py` the
YAML validation, `tags.py` the tag and cue parsers, `paths.py` where the scenario files are and the default one.
The file format is in `docs/scenario_schema.md`.
"""
from llm_agent.scenario.paths import (DEFAULT_SCENARIO_NAME, DEFAULT_SCENARIO_PATH, SCENARIO_DIR, SHIPPED_SCENARIO_PATHS,
                                      TOKENIZER_SCENARIO_PATHS, scenario_path)
from llm_agent.scenario.scenario import (CUE_KEYS, EVENTS, LINE_KEYS, AgentTurn, Behavior, CategoryScript, CueList,
                                         Dimension, Scenario, ScenarioError, ScriptedRules, ScriptedSpec, ScriptedStep,
                                         Stage, StateRange, StateSchema, Statuses, TagProtocol, Turn, UserProfile,
                                         UserTurn, load_behavior_library, load_scenario, sample_behaviors)
from llm_agent.scenario.diagnosis_spec import RULE_KINDS, DiagnosisRule, DoubtCues

__all__ = [
    "DEFAULT_SCENARIO_NAME", "DEFAULT_SCENARIO_PATH", "SCENARIO_DIR", "SHIPPED_SCENARIO_PATHS",
    "TOKENIZER_SCENARIO_PATHS", "scenario_path", "CUE_KEYS", "EVENTS", "LINE_KEYS", "AgentTurn", "Behavior",
    "CategoryScript", "CueList", "Dimension", "Scenario", "ScenarioError", "ScriptedRules", "ScriptedSpec",
    "ScriptedStep", "Stage", "StateRange", "StateSchema", "Statuses", "TagProtocol", "Turn", "UserProfile",
    "UserTurn", "load_behavior_library", "load_scenario", "sample_behaviors", "RULE_KINDS", "DiagnosisRule",
    "DoubtCues",
]
