"""Start-up of the optional tracking backends (wandb, mlflow), imported only when selected.

wandb honours the user's own settings: `WANDB_MODE` when set; otherwise online when credentials exist (a
`WANDB_API_KEY`, or the netrc entry `wandb login` writes for the API host) and offline when nothing is
configured, so a run never reaches the network by accident and never silently stays offline after a login.
mlflow logs to `MLFLOW_TRACKING_URI` when set, else to a local file store `<log_dir>/mlruns` (no server needed).
"""
from __future__ import annotations

import logging
import netrc
import os
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

__all__ = ["MlflowRun", "flatten", "wandb_mode"]


def _has_wandb_login() -> bool:
    """True when ~/.netrc (or $NETRC) holds credentials for the wandb API host."""
    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def wandb_mode() -> str:
    """The wandb mode to use: `WANDB_MODE` if set, online with credentials, offline with none."""
    mode = os.environ.get("WANDB_MODE", "").strip()
    if mode:
        return mode
    return "online" if os.environ.get("WANDB_API_KEY") or _has_wandb_login() else "offline"


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a.b.c": value} for a nested mapping (lists kept as values)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


class MlflowRun:
    """One mlflow run: the config as parameters, metrics per step; `finish()` ends it."""

    MAX_PARAM_CHARS = 500  # mlflow's limit on a parameter value

    def __init__(self, project: str, experiment: str, config: Mapping[str, Any], log_dir: str) -> None:
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # a local store that needs no server; mlflow asks for an explicit opt-in to its file store
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = "file:" + os.path.abspath(os.path.join(log_dir, "mlruns"))
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(project)
        experiment_id = found.experiment_id if found else self.client.create_experiment(project)
        self.run_id = self.client.create_run(experiment_id, run_name=experiment).info.run_id
        params = [Param(k, str(v)[:self.MAX_PARAM_CHARS]) for k, v in flatten(config).items()]
        for start in range(0, len(params), 100):  # mlflow takes at most 100 parameters per batch
            self.client.log_batch(self.run_id, params=params[start:start + 100])
        logger.info("Tracking: mlflow run %s of experiment %r at %s", self.run_id, project, uri)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Log the step's scalar metrics."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(key, float(value), now, step) for key, value in metrics.items()]
        for start in range(0, len(batch), 1000):  # mlflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=batch[start:start + 1000])

    def log_text(self, text: str, name: str) -> None:
        """Store `text` as an artifact file `name` of the run."""
        self.client.log_text(self.run_id, text, name)

    def finish(self) -> None:
        """Mark the run finished."""
        self.client.set_terminated(self.run_id)
