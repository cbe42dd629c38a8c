"""Text mechanics of scenarios: `${name}` templates, cue-phrase matching and the XML-like tag protocol.

Everything here is pure string work with no knowledge of YAML files; `llm_agent.scenario` builds on it. The
rules are documented in `docs/scenario_schema.md` (sections 1, 5 and "Parsing rules").
"""
from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

_PLACEHOLDER = re.compile(r"\$(?:\$|\{([A-Za-z_][A-Za-z0-9_]*)\}|(\{))")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LEADING_INT = re.compile(r"\s*([+-]?\d+)(?![\d.])")


class TemplateError(ValueError):
    """A template string is malformed (an opened `${` that is not `${identifier}`)."""


def placeholders(template: str) -> list[str]:
    """Return the `${name}` placeholder names of `template` in order of appearance (`$$` is an escape).

    Raises TemplateError on a `${` that does not close as `${identifier}`.
    """
    names = []
    for m in _PLACEHOLDER.finditer(template):
        if m.group(2) is not None:
            snippet = template[m.start():m.start() + 20].splitlines()[0]
            raise TemplateError(f"malformed placeholder starting at {snippet!r}: use ${{identifier}}")
        if m.group(1) is not None:
            names.append(m.group(1))
    return names


def substitute(template: str, values: Mapping[str, str], keep_unknown: bool = False) -> str:
    """Fill `${name}` from `values`; `$$` becomes `$` unless `keep_unknown` (a partial pass keeps it escaped).

    With `keep_unknown`, names missing from `values` stay as written (used for the load-time static pass that
    leaves the dynamic placeholders for render time); otherwise a missing name raises KeyError.
    """
    def repl(m: re.Match) -> str:
        if m.group(2) is not None:
            raise TemplateError(f"malformed placeholder at offset {m.start()}")
        name = m.group(1)
        if name is None:
            return "$$" if keep_unknown else "$"
        if name in values:
            value = str(values[name])
            return value.replace("$", "$$") if keep_unknown else value
        if keep_unknown:
            return m.group(0)
        raise KeyError(name)

    return _PLACEHOLDER.sub(repl, template)


def bulleted_placeholders(template: str, names: Iterable[str]) -> list[str]:
    """Return those of `names` that appear in `template` right after a list bullet (`- `, `* `, `1. `)."""
    bad = []
    for name in names:
        pattern = re.compile(r"^[ \t]*(?:[-*\u2022]|\d+[.)])[ \t]*\$\{" + re.escape(name) + r"\}", re.MULTILINE)
        if pattern.search(template):
            bad.append(name)
    return bad


def bullets(items: Iterable[str]) -> str:
    """Render `items` as `- item` lines (one per item, no trailing newline)."""
    return "\n".join(f"- {item}" for item in items)


def _compile_cue(source: str) -> re.Pattern:
    if source.startswith("re:"):
        return re.compile(source[3:], re.IGNORECASE)
    phrase = " ".join(source.lower().split())
    body = r"\s+".join(re.escape(word) for word in phrase.split(" "))
    left = r"\b" if re.match(r"\w", phrase) else ""
    right = r"\b" if re.search(r"\w$", phrase) else ""
    return re.compile(left + body + right, re.IGNORECASE)


@dataclass(frozen=True)
class CueList:
    """A list of cue phrases matched against spoken text (plain phrases with word boundaries, or `re:` regexes)."""

    sources: tuple[str, ...]
    _patterns: tuple[re.Pattern, ...] = field(default=(), repr=False, compare=False)

    @classmethod
    def compile(cls, sources: Iterable[str]) -> "CueList":
        """Compile cue `sources`; raises re.error (with the offending entry) on a bad `re:` entry."""
        srcs = tuple(sources)
        patterns = []
        for src in srcs:
            try:
                patterns.append(_compile_cue(src))
            except re.error as exc:
                raise re.error(f"bad regex cue {src!r}: {exc}") from exc
        return cls(srcs, tuple(patterns))

    def hits(self, text: str) -> list[str]:
        """Return the cue sources that occur in `text` (case-insensitive)."""
        return [src for src, pat in zip(self.sources, self._patterns) if pat.search(text)]

    def matches(self, text: str) -> bool:
        """True when any cue occurs in `text`."""
        return any(pat.search(text) for pat in self._patterns)


@functools.lru_cache(maxsize=256)
def _open_re(tag: str) -> re.Pattern:
    return re.compile(r"<\s*" + re.escape(tag) + r"\s*>", re.IGNORECASE)


@functools.lru_cache(maxsize=256)
def _block_re(tag: str) -> re.Pattern:
    t = re.escape(tag)
    return re.compile(r"<\s*" + t + r"\s*>(.*?)<\s*/\s*" + t + r"\s*>", re.IGNORECASE | re.DOTALL)


def any_tag_re(tags: Iterable[str]) -> re.Pattern:
    """A regex matching an opening or closing of any of `tags`."""
    return _any_tag_re(tuple(sorted(set(tags), key=lambda t: (-len(t), t))))


@functools.lru_cache(maxsize=64)
def _any_tag_re(tags: tuple[str, ...]) -> re.Pattern:
    alt = "|".join(re.escape(t) for t in tags)
    return re.compile(r"<\s*/?\s*(?:" + alt + r")\s*>", re.IGNORECASE)


def extract_tag(text: str, tag: str, all_tags: Iterable[str]) -> tuple[str | None, list[str]]:
    """Extract the content of `tag` from `text` following the documented rules.

    Returns (content or None, flags) where flags is a subset of {"multiple", "unclosed", "missing"}: the last
    closed block wins; with no closed block, the text after the last opening up to the next protocol tag (or
    the end) is taken; no opening at all gives None.
    """
    blocks = _block_re(tag).findall(text)
    if blocks:
        return blocks[-1], (["multiple"] if len(blocks) > 1 else [])
    openings = list(_open_re(tag).finditer(text))
    if not openings:
        return None, ["missing"]
    rest = text[openings[-1].end():]
    nxt = any_tag_re(all_tags).search(rest)
    return (rest[:nxt.start()] if nxt else rest), ["unclosed"]


_INT_CAP = 10 ** 18  # beyond any range; keeps int() away from Python's 4300-digit conversion limit


def parse_int(content: str) -> int | None:
    """Read a leading signed integer (`-1`, `+2`, `3 (calm)`); None for `2.5`, words or empty text.

    A magnitude beyond 10**18 (however many digits) reads as +-10**18, which every range then clamps.
    """
    m = _LEADING_INT.match(content)
    if m is None:
        return None
    text = m.group(1)
    sign = -1 if text[0] == "-" else 1
    digits = text.lstrip("+-").lstrip("0") or "0"
    return sign * (_INT_CAP if len(digits) > 18 else min(int(digits), _INT_CAP))


def strip_tags(text: str, tags: Iterable[str]) -> tuple[str, bool]:
    """Remove whole `<tag>...</tag>` blocks of `tags`, then any stray opening/closing of them.

    Returns (text with whitespace runs collapsed if anything was removed, whether anything was removed).
    """
    tags = list(tags)
    count = 0
    for tag in tags:
        text, n = _block_re(tag).subn(" ", text)
        count += n
    text, n = any_tag_re(tags).subn(" ", text)
    count += n
    return (" ".join(text.split()) if count else text), count > 0


def format_tags(pairs: Iterable[tuple[str, object]]) -> str:
    """Write `<tag>value</tag>` lines for the (tag, value) pairs whose value is not None."""
    return "\n".join(f"<{tag}>{value}</{tag}>" for tag, value in pairs if value is not None)


def is_identifier(name: str) -> bool:
    """True when `name` is a valid tag or placeholder identifier."""
    return bool(_NAME.fullmatch(name))
