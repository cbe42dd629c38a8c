"""Reading dialogue logs: an evaluation's `<name>_dialogues.jsonl` or a training run's `rollouts.jsonl`.

Both hold one JSON object per line in the rollout log's format (`llm_agent.rollout.records.log_lines`: `step`,
`split`, then the per-dialogue record). Each line is decoded by the project's policy for outside input
(`verl.utils.untrusted.load_json`: size and nesting limits, text cleaned). A process killed mid-append can leave a
torn last line (no newline, not valid JSON); `read_dialogue_log` skips it and says so, and `drop_torn_tail` moves
its bytes to ``<path>.torn`` and cuts it off before new lines are appended. Any other unreadable line is an error
naming the file and line.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl.utils.untrusted import load_json

logger = logging.getLogger(__name__)

__all__ = ["DialogueLog", "MAX_LINE_BYTES", "TORN_SUFFIX", "drop_torn_tail", "latest_per_dialogue",
           "read_dialogue_log"]

MAX_LINE_BYTES = 64 << 20  # a dialogue record is tens of KB
TORN_SUFFIX = ".torn"


@dataclass
class DialogueLog:
    """The records of a log file, the line number of each, and the byte length of its complete lines
    (`valid_bytes`)."""

    path: Path
    records: list[dict[str, Any]]
    valid_bytes: int
    torn_tail: bool
    line_numbers: list[int] = field(default_factory=list)


def read_dialogue_log(path: str | os.PathLike) -> DialogueLog:
    """Every complete line of `path` as a dict; a torn last line is skipped (see the module docstring)."""
    path = Path(path)
    data = path.read_bytes()
    records: list[dict[str, Any]] = []
    numbers: list[int] = []
    offset, lineno, torn = 0, 0, False
    while offset < len(data):
        end = data.find(b"\n", offset)
        complete = end >= 0
        raw = data[offset:end if complete else len(data)]
        lineno += 1
        if raw.strip():
            try:
                value = load_json(raw, what="line", max_bytes=MAX_LINE_BYTES)
                if not isinstance(value, dict):
                    raise ValueError(f"a JSON {type(value).__name__}, not an object")
            except ValueError as exc:
                if not complete:
                    logger.warning("%s:%d: ignoring a torn last line (%d bytes; the writer was interrupted)",
                                   path, lineno, len(raw))
                    torn = True
                    break
                raise ValueError(f"{path}:{lineno}: not a JSON object line ({str(exc).removeprefix('line: ')})"
                                 ) from None
            records.append(value)
            numbers.append(lineno)
        if not complete:
            offset = len(data)
            break
        offset = end + 1
    return DialogueLog(path=path, records=records, valid_bytes=offset, torn_tail=torn, line_numbers=numbers)


def drop_torn_tail(log: DialogueLog) -> None:
    """When `log` found a torn last line, append its bytes to ``<path>.torn`` (fsynced) and truncate the file to its
    complete lines, so appends start on a new line. A complete last line without a newline (valid JSON) gets one
    appended instead."""
    size = log.path.stat().st_size
    if log.torn_tail:
        kept = log.path.with_name(log.path.name + TORN_SUFFIX)
        with open(log.path, "rb") as source, open(kept, "ab") as f:
            source.seek(log.valid_bytes)
            f.write(source.read())
            f.flush()
            os.fsync(f.fileno())
        os.truncate(log.path, log.valid_bytes)
        logger.warning("%s: cut a torn last line (%d bytes, kept in %s)", log.path, size - log.valid_bytes, kept)
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
