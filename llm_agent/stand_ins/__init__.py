"""Scripted stand-ins for tests, benchmarks and the SFT warm start; never used by a production run.

`scripted_policy.py`: a scripted service agent and a worker group that answers `generate_sequences` with it.
`inprocess_user_sim.py`: the scripted persona behind the simulator client's interface, with no HTTP server.
"""
