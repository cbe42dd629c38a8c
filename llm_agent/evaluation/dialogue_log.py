"""Reading dialogue logs: an evaluation's `<name>_dialogues.jsonl` or a training run's `rollouts.jsonl`.

Both hold one JSON object per line in the rollout log's format (`llm_agent.rollout.records.log_lines`: `step`,
`split`, then the per-dialogue record). A process killed mid-append can leave a torn last line (no newline, not
valid JSON); `read_dialogue_log` skips it and says so, and `drop_torn_tail` cuts it off before new lines are
appended. Any other unreadable line is an error naming the file and line.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["DialogueLog", "drop_torn_tail", "latest_per_dialogue", "read_dialogue_log"]


@dataclass
class DialogueLog:
    """The records of a log file and the byte length of its complete lines (`valid_bytes`)."""

    path: Path
    records: list[dict[str, Any]]
    valid_bytes: int
    torn_tail: bool


def read_dialogue_log(path: str | os.PathLike) -> DialogueLog:
    """Every complete line of `path` as a dict; a torn last line is skipped (see the module docstring)."""
    path = Path(path)
    data = path.read_bytes()
    records: list[dict[str, Any]] = []
    offset, lineno, torn = 0, 0, False
    while offset < len(data):
        end = data.find(b"\n", offset)
        complete = end >= 0
        raw = data[offset:end if complete else len(data)]
        lineno += 1
        if raw.strip():
            try:
                value = json.loads(raw)
                if not isinstance(value, dict):
                    raise ValueError(f"a JSON {type(value).__name__}, not an object")
            except ValueError as exc:
                if not complete:
                    logger.warning("%s:%d: ignoring a torn last line (%d bytes; the writer was interrupted)",
                                   path, lineno, len(raw))
                    torn = True
                    break
                raise ValueError(f"{path}:{lineno}: not a JSON object line ({exc})") from None
            records.append(value)
        if not complete:
            offset = len(data)
            break
        offset = end + 1
    return DialogueLog(path=path, records=records, valid_bytes=offset, torn_tail=torn)


def drop_torn_tail(log: DialogueLog) -> None:
    """Truncate the file to its complete lines when `log` found a torn last line, so appends start on a new line.
    A complete last line without a newline (valid JSON) gets one appended instead."""
    size = log.path.stat().st_size
    if log.torn_tail:
        os.truncate(log.path, log.valid_bytes)
        logger.warning("%s: cut a torn last line (%d bytes)", log.path, size - log.valid_bytes)
    elif size and not log.path.read_bytes().endswith(b"\n"):
        with open(log.path, "a", encoding="utf-8") as f:
            f.write("\n")


def latest_per_dialogue(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{dialogue_id: its last record}: a dialogue run again (e.g. an error retried) counts once, as its last run."""
    out: dict[str, dict[str, Any]] = {}
    for i, record in enumerate(records):
        dialogue_id = record.get("dialogue_id")
        if not isinstance(dialogue_id, str):
            raise ValueError(f"record {i}: no string 'dialogue_id' (got {dialogue_id!r})")
        out[dialogue_id] = record
    return out
