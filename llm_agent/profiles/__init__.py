"""Believable user profiles: the rule table of contradicting behaviour categories, pools of profiles written
ahead, and the LLM profile writer (`utils/generate_profiles.py` is its command line).

`rules.py` the rule-based consistency filter (`assets/behavior_rules.yaml`), `pool.py` reading and drawing from
profile files, `answers.py` the LLM request and the checks of its answers, `sources.py` the weights files and the
OpenAI-compatible endpoint, `writer.py` the resumable, concurrent writer.
"""
