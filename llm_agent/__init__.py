"""The dialogue side of SEAD: scenarios, the multi-turn rollout loop, the user-simulator client and server.

Builds on `verl` (the engine never imports this package). See `docs/scenario_schema.md` for scenario files.
"""
