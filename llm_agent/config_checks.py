"""The shared first check of every dialogue-side config block: a mapping whose keys are a dataclass's fields."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


def checked_mapping(data: Any, cls: type, where: str, error: type[Exception] = ValueError) -> dict[str, Any]:
    """`data` as a plain dict (None gives {}); raises `error` naming `where` when it is not a mapping or has a key
    that is not a field of the dataclass `cls` (the message lists the known keys)."""
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise error(f"{where}: must be a mapping, got {type(data).__name__}")
    known = sorted(f.name for f in dataclasses.fields(cls))
    unknown = sorted(str(k) for k in data if k not in known)
    if unknown:
        raise error(f"{where}: unknown key(s) {unknown}; known keys: {known}")
    return {str(k): v for k, v in data.items()}
