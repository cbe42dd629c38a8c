"""The training config a checkpoint was made with: `global_step_N/trainer_config.json`.

The trainer writes it into every checkpoint: the resolved config of the run (every key, interpolations resolved)
and the working directory it ran in (relative paths in the config are relative to it). Secrets are never written:
a key named `api_key`, `secret`, `password` or `token`, or ending in `_<one of those>`, is stored as null when it
held a value. Readers (an evaluation taking its defaults from the checkpoint it evaluates) get a `RunConfig`.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl.utils.untrusted import UntrustedInputError, load_json

__all__ = ["CONFIG_FILE", "RunConfig", "load_run_config", "redact_secrets", "save_run_config"]

CONFIG_FILE = "trainer_config.json"
MAX_CONFIG_BYTES = 16 << 20  # a resolved trainer config is tens of KB
REDACTED = None
_SECRET_KEY = re.compile(r"(^|_)(api_key|secret|password|token)$")


def redact_secrets(value: Any) -> Any:
    """`value` (nested mappings and lists) with the value of every secret-named key replaced by null."""
    if isinstance(value, Mapping):
        return {str(k): REDACTED if _SECRET_KEY.search(str(k)) and v is not None else redact_secrets(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_secrets(v) for v in value]
    return value


@dataclass(frozen=True)
class RunConfig:
    """A checkpoint's recorded training config and the directory the run worked in."""

    config: dict[str, Any]
    cwd: str
    path: Path

    def select(self, dotted: str) -> Any:
        """The value at a dotted key ("rollout_loop.config.max_turns"); None when a part is missing."""
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return None
            node = node[part]
        return node

    def resolve(self, path: str) -> str:
        """`path` as the run meant it: absolute as is, else relative to the run's working directory."""
        return path if os.path.isabs(path) else os.path.join(self.cwd, path)


def save_run_config(directory: str | os.PathLike, config: Mapping[str, Any], cwd: str | None = None) -> Path:
    """Write `directory/trainer_config.json` (secrets redacted); returns its path."""
    from verl.utils.checkpoint import atomic_write_text  # the checkpoint module imports torch

    path = Path(directory) / CONFIG_FILE
    body = {"cwd": cwd if cwd is not None else os.getcwd(), "config": redact_secrets(config)}
    atomic_write_text(path, json.dumps(body, indent=1, sort_keys=True, default=str) + "\n")
    return path


def load_run_config(directory: str | os.PathLike) -> RunConfig | None:
    """The `RunConfig` of checkpoint `directory`; None when it has no trainer_config.json (an older checkpoint);
    ValueError naming the file when it cannot be read."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        body = load_json(path.read_bytes(), what=f"the training config {path}", max_bytes=MAX_CONFIG_BYTES)
    except OSError as exc:
        raise ValueError(f"cannot read the training config {path}: {exc}") from None
    except UntrustedInputError as exc:
        raise ValueError(f"cannot read {exc}") from None
    if not isinstance(body, dict) or not isinstance(body.get("config"), dict) or not isinstance(body.get("cwd"), str):
        raise ValueError(f"{path}: expected {{'cwd': str, 'config': {{...}}}}")
    return RunConfig(config=body["config"], cwd=body["cwd"], path=path)
