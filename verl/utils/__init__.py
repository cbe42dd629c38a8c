"""Utilities of the RL engine (tensor maths, device selection, tracking, checkpoints, datasets)."""
