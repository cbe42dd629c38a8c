"""Experiment tracking: send each step's scalar metrics to one or more backends.

Backends: "console" (one compact log line per step), "jsonl" (one JSON object per step appended to
`<log_dir>/metrics.jsonl`), "wandb" (the user's own mode: `WANDB_MODE`, else online after `wandb login` or with
`WANDB_API_KEY`, else offline; run files under `<log_dir>/wandb`), "tensorboard" (event files under
`<log_dir>/tensorboard`) and "mlflow" (`MLFLOW_TRACKING_URI`, else a local store `<log_dir>/mlruns`).
wandb, tensorboard and mlflow are imported only when selected. `log_table` records a table of text rows (e.g.
validation dialogues) on the backends that show tables.
"""

from __future__ import annotations

import json
import logging
import numbers
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from verl.utils.tracking_backends import MlflowRun, wandb_mode

logger = logging.getLogger(__name__)
console_logger = logging.getLogger("verl.tracking")

SUPPORTED_BACKENDS = ("console", "jsonl", "wandb", "tensorboard", "mlflow")


def _to_scalar(key: str, value: Any) -> float | int:
    """Return `value` as a Python number; one-element tensors/arrays are unwrapped, anything else is an error."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        size = value.size if isinstance(value, np.ndarray) else value.numel()
        if size != 1:
            raise ValueError(
                f"Tracking.log: metric {key!r} is a tensor/array of shape {tuple(value.shape)}, not a scalar"
            )
        value = value.item()
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"Tracking.log: metric {key!r} must be a number, got {type(value).__name__}: {value!r}")
    return value if isinstance(value, int) else float(value)


def _plain_config(config: Any) -> dict:
    """Turn a dict or OmegaConf config into plain containers (interpolations resolved) for the backends."""
    from omegaconf import DictConfig, OmegaConf

    if config is None:
        return {}
    if isinstance(config, DictConfig):
        return OmegaConf.to_container(config, resolve=True)
    if isinstance(config, Mapping):
        return dict(config)
    raise TypeError(f"Tracking: config must be a mapping or an OmegaConf DictConfig, got {type(config).__name__}")


def _format_value(value: float | int) -> str:
    """Compact text for the console line: integers as is, floats with 6 significant digits."""
    return str(value) if isinstance(value, int) else f"{value:.6g}"


def _markdown_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table; cell text has its pipes escaped and newlines turned into <br>."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(map(cell, columns)) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
    return "\n".join(lines)


class Tracking:
    """Log scalar metrics per step to the selected backends; call `finish()` (or use `with`) at the end."""

    def __init__(
        self,
        project_name: str,
        experiment_name: str,
        default_backend: str | Sequence[str] = "console",
        config: Mapping | Any | None = None,
        log_dir: str | os.PathLike | None = None,
    ) -> None:
        backends = [default_backend] if isinstance(default_backend, str) else list(default_backend)
        unknown = [b for b in backends if b not in SUPPORTED_BACKENDS]
        if unknown:
            raise ValueError(f"Tracking: unknown backend(s) {unknown}; valid backends are {list(SUPPORTED_BACKENDS)}")
        self.backends = list(dict.fromkeys(backends))
        self.project_name, self.experiment_name = project_name, experiment_name
        default_dir = os.path.join("outputs", project_name, experiment_name)
        self.log_dir = os.fspath(log_dir) if log_dir is not None else default_dir
        self.config = _plain_config(config)
        self._jsonl = None
        self._wandb_run = None
        self._tb_writer = None
        self._mlflow: MlflowRun | None = None
        self._finished = False
        if any(b != "console" for b in self.backends):
            os.makedirs(self.log_dir, exist_ok=True)
        if "console" in self.backends:
            self._setup_console()
        if "jsonl" in self.backends:
            self._jsonl = open(os.path.join(self.log_dir, "metrics.jsonl"), "a", encoding="utf-8")
        if "wandb" in self.backends:
            self._wandb_run = self._init_wandb()
        if "tensorboard" in self.backends:
            from torch.utils.tensorboard import SummaryWriter

            self._tb_writer = SummaryWriter(log_dir=os.path.join(self.log_dir, "tensorboard"))
            self._tb_writer.add_text("config", json.dumps(self.config, indent=2, default=str))
        if "mlflow" in self.backends:
            self._mlflow = MlflowRun(project_name, experiment_name, self.config, self.log_dir)

    @staticmethod
    def _setup_console() -> None:
        """Make sure console lines are shown: INFO level, and a stdout handler if logging is unconfigured."""
        if console_logger.getEffectiveLevel() > logging.INFO:
            console_logger.setLevel(logging.INFO)
        if not console_logger.hasHandlers():
            console_logger.addHandler(logging.StreamHandler(sys.stdout))

    def _init_wandb(self) -> Any:
        """Start a wandb run under log_dir in the user's mode (see `tracking_backends.wandb_mode`)."""
        import wandb

        mode = wandb_mode()
        logger.info(
            "Tracking: wandb run %s/%s in %s mode under %s", self.project_name, self.experiment_name, mode, self.log_dir
        )
        return wandb.init(
            project=self.project_name, name=self.experiment_name, config=self.config, dir=self.log_dir, mode=mode
        )

    def log(self, data: Mapping[str, Any], step: int) -> None:
        """Record the scalar metrics in `data` for training step `step` on every backend."""
        if self._finished:
            raise RuntimeError("Tracking.log called after finish()")
        metrics = {str(key): _to_scalar(str(key), value) for key, value in data.items()}
        step = int(step)
        if "console" in self.backends:
            parts = [f"step:{step}"] + [f"{key}:{_format_value(value)}" for key, value in metrics.items()]
            console_logger.info(" - ".join(parts))
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
            self._jsonl.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(metrics, step=step)
        if self._tb_writer is not None:
            for key, value in metrics.items():
                self._tb_writer.add_scalar(key, value, global_step=step)
            self._tb_writer.flush()
        if self._mlflow is not None:
            self._mlflow.log(metrics, step)

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int) -> None:
        """Record a table of text rows for step `step`: a wandb Table, a Markdown text in tensorboard, an mlflow
        artifact and a JSON line in `<log_dir>/<name with / as _>.jsonl` with the jsonl backend (console: nothing)."""
        if self._finished:
            raise RuntimeError("Tracking.log_table called after finish()")
        rows = [[str(cell) for cell in row] for row in rows]
        if any(len(row) != len(columns) for row in rows):
            raise ValueError(f"Tracking.log_table: every row needs {len(columns)} cells ({list(columns)})")
        if self._jsonl is not None:
            with open(os.path.join(self.log_dir, name.replace("/", "_") + ".jsonl"), "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": int(step), "columns": list(columns), "rows": rows}) + "\n")
        if self._wandb_run is not None:
            import wandb

            self._wandb_run.log({name: wandb.Table(columns=list(columns), data=rows)}, step=int(step))
        markdown = _markdown_table(columns, rows)
        if self._tb_writer is not None:
            self._tb_writer.add_text(name, markdown, global_step=int(step))
            self._tb_writer.flush()
        if self._mlflow is not None:
            self._mlflow.log_text(markdown, f"{name}/step_{int(step)}.md")

    def finish(self) -> None:
        """Flush and close every backend; safe to call more than once."""
        if self._finished:
            return
        self._finished = True
        if self._jsonl is not None:
            self._jsonl.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
        if self._tb_writer is not None:
            self._tb_writer.close()
        if self._mlflow is not None:
            self._mlflow.finish()

    def __enter__(self) -> Tracking:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.finish()
