"""Workers of the RL engine: FSDP2/FSDP1 actor/rollout/reference and critic workers, and their building blocks.

Import the submodules explicitly (`verl.workers.fsdp_workers`, `verl.workers.actor`, ...); this package
imports nothing heavy itself.
"""
