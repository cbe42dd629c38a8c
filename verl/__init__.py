"""verl: the RL engine of SEAD (veRL-style single controller, FSDP workers, PPO/GRPO).

Kept import-light on purpose: `import verl` pulls in nothing heavy; import submodules such as
`verl.protocol` explicitly.
"""

__version__ = "0.1.0"
