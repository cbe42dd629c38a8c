"""Text mechanics of scenarios: `${name}` templates, cue-phrase matching and the XML-like tag protocol.

Everything here is pure string work with no knowledge of YAML files; `llm_agent.scenario` builds on it. The
rules are documented in `docs/scenario_schema.md` (sections 1, 5 and "Parsing rules").
"""
from __future__ import annotations

import bisect
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
    # `matches` in one search: the plain phrases as one alternation, the `re:` entries (which may hold groups,
    # back-references or inline flags) each on their own
    _any_phrase: re.Pattern | None = field(default=None, repr=False, compare=False)
    _regexes: tuple[re.Pattern, ...] = field(default=(), repr=False, compare=False)

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
        phrases = [p.pattern for src, p in zip(srcs, patterns) if not src.startswith("re:")]
        any_phrase = re.compile("|".join(f"(?:{p})" for p in phrases), re.IGNORECASE) if phrases else None
        regexes = tuple(p for src, p in zip(srcs, patterns) if src.startswith("re:"))
        return cls(srcs, tuple(patterns), any_phrase, regexes)

    def hits(self, text: str) -> list[str]:
        """Return the cue sources that occur in `text` (case-insensitive)."""
        return [src for src, pat in zip(self.sources, self._patterns) if pat.search(text)]

    def matches(self, text: str) -> bool:
        """True when any cue occurs in `text`."""
        if self._any_phrase is not None and self._any_phrase.search(text):
            return True
        return any(pat.search(text) for pat in self._regexes)


# One opening or closing of any identifier-named tag: `<name>`, `< / name >` (case-insensitive names). Linear:
# every branch after `<` consumes characters that can never be `<`, so each scan ends before the next `<`.
_TAG_TOKEN = re.compile(r"<\s*(?:(/)\s*)?([A-Za-z0-9_]+)\s*>")


class TagScan:
    """The tag openings/closings of one text, found in a single linear scan; answers `extract` per tag."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens: list[tuple[int, int, str, bool]] = [  # (start, end, lower-cased name, is closing)
            (m.start(), m.end(), m.group(2).lower(), m.group(1) is not None) for m in _TAG_TOKEN.finditer(text)]
        self._by_name: dict[str, list[tuple[int, int, str, bool]]] = {}
        for token in self.tokens:
            self._by_name.setdefault(token[2], []).append(token)

    def blocks(self, tag: str) -> list[tuple[int, int, int, int]]:
        """(block start, content start, content end, block end) of each `<tag>...</tag>` block, left to right:
        an opening pairs with the first closing after it and openings inside a block are ignored (the semantics
        of a lazy `<tag>(.*?)</tag>` regex, without its quadratic time)."""
        pairs, opening = [], None
        for start, end, _, closing in self._by_name.get(tag.lower(), ()):
            if closing and opening is not None:
                pairs.append((opening[0], opening[1], start, end))
                opening = None
            elif not closing and opening is None:
                opening = (start, end)
        return pairs

    def extract(self, tag: str, all_tags: Iterable[str]) -> tuple[str | None, list[str]]:
        """`extract_tag` on the scanned text."""
        blocks = self.blocks(tag)
        if blocks:
            _, content_start, content_end, _ = blocks[-1]
            return self.text[content_start:content_end], (["multiple"] if len(blocks) > 1 else [])
        openings = [t for t in self._by_name.get(tag.lower(), ()) if not t[3]]
        if not openings:
            return None, ["missing"]
        after = openings[-1][1]
        protocol = {t.lower() for t in all_tags}
        nxt = next((t[0] for t in self.tokens[bisect.bisect_left(self.tokens, (after,)):] if t[2] in protocol),
                   len(self.text))
        return self.text[after:nxt], ["unclosed"]


def any_tag_re(tags: Iterable[str]) -> re.Pattern:
    """A regex matching an opening or closing of any of `tags` (for callers; linear on any input)."""
    return _any_tag_re(tuple(sorted(set(tags), key=lambda t: (-len(t), t))))


@functools.lru_cache(maxsize=64)
def _any_tag_re(tags: tuple[str, ...]) -> re.Pattern:
    alt = "|".join(re.escape(t) for t in tags)
    return re.compile(r"<\s*(?:/\s*)?(?:" + alt + r")\s*>", re.IGNORECASE)


def extract_tag(text: str, tag: str, all_tags: Iterable[str]) -> tuple[str | None, list[str]]:
    """Extract the content of `tag` from `text` following the documented rules (in time linear in `text`).

    Returns (content or None, flags) where flags is a subset of {"multiple", "unclosed", "missing"}: the last
    closed block wins; with no closed block, the text after the last opening up to the next protocol tag (or
    the end) is taken; no opening at all gives None.
    """
    return TagScan(text).extract(tag, all_tags)


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


def _cut(text: str, spans: list[tuple[int, int]]) -> str:
    """`text` with each (start, end) span (sorted, disjoint) replaced by one space."""
    parts, pos = [], 0
    for start, end in spans:
        parts += [text[pos:start], " "]
        pos = end
    return "".join(parts) + text[pos:]


def strip_tags(text: str, tags: Iterable[str]) -> tuple[str, bool]:
    """Remove whole `<tag>...</tag>` blocks of `tags` (tag by tag), then any stray opening/closing of them.

    Returns (text with whitespace runs collapsed if anything was removed, whether anything was removed).
    """
    tags = list(tags)
    count = 0
    for tag in tags:
        blocks = TagScan(text).blocks(tag)
        if blocks:
            text = _cut(text, [(b[0], b[3]) for b in blocks])
            count += len(blocks)
    protocol = {t.lower() for t in tags}
    stray = [(t[0], t[1]) for t in TagScan(text).tokens if t[2] in protocol]
    if stray:
        text = _cut(text, stray)
        count += len(stray)
    return (" ".join(text.split()) if count else text), count > 0


def format_tags(pairs: Iterable[tuple[str, object]]) -> str:
    """Write `<tag>value</tag>` lines for the (tag, value) pairs whose value is not None."""
    return "\n".join(f"<{tag}>{value}</{tag}>" for tag, value in pairs if value is not None)


def is_identifier(name: str) -> bool:
    """True when `name` is a valid tag or placeholder identifier."""
    return bool(_NAME.fullmatch(name))
