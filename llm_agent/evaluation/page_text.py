"""Text from runs and files as the HTML pages show it: every string bounded, so one huge field (a 64 MB reply in a
log, a card's example) cannot make a page of that size; what is cut ends with a marker saying how much."""
from __future__ import annotations

import html
from typing import Any

__all__ = ["MAX_PAGE_STRING", "bounded", "cut_text", "esc"]

MAX_PAGE_STRING = 20_000  # characters of one string on a page; a dialogue turn is rarely over 2,000


def cut_text(text: str, limit: int = MAX_PAGE_STRING) -> str:
    """`text`, or its first `limit` characters and a marker naming how many more there were."""
    return text if len(text) <= limit else f"{text[:limit]}… [{len(text) - limit} more characters cut]"


def bounded(value: Any, limit: int = MAX_PAGE_STRING) -> Any:
    """`value` (JSON-like data) with every string, keys included, cut by :func:`cut_text`."""
    if isinstance(value, str):
        return cut_text(value, limit)
    if isinstance(value, dict):
        return {bounded(k, limit): bounded(v, limit) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [bounded(v, limit) for v in value]
    return value


def esc(value: Any) -> str:
    """`value` as text for HTML: cut by :func:`cut_text`, then escaped (quotes included)."""
    return html.escape(cut_text(str(value)), quote=True)
