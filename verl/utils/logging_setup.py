"""Process-wide logging for the entry points: our loggers at the chosen level, third-party libraries quiet.

Libraries such as httpx log every HTTP request at INFO (thousands of lines a step when the rollout loop talks to
the simulators); they stay at WARNING unless `SEAD_LOG_LEVEL=DEBUG` asks for everything.
"""
from __future__ import annotations

import logging
import os

__all__ = ["QUIET_LIBRARIES", "configure_logging"]

QUIET_LIBRARIES = ("httpx", "httpcore", "urllib3", "filelock", "asyncio", "ray", "wandb", "mlflow", "matplotlib",
                   "PIL", "fsspec", "transformers", "torch.distributed", "hydra", "uvicorn.access")


def configure_logging(level: str | None = None) -> str:
    """Configure the root logger at `level` (default `SEAD_LOG_LEVEL`, else INFO) with a timestamped format and
    set the third-party loggers to WARNING (left alone at DEBUG). Returns the level used."""
    level = (level or os.environ.get("SEAD_LOG_LEVEL") or "INFO").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level != "DEBUG":
        for name in QUIET_LIBRARIES:
            logging.getLogger(name).setLevel(logging.WARNING)
    return level
