"""The fenced command blocks of README.md and docs/*.md, and how CI covers each one.

A command block is a fence in one of `COMMAND_LANGUAGES`. The line right before its opening fence says how it is
covered, as an HTML comment (invisible on the rendered page):

    <!-- commands: run -->                 run as written in a fresh clone with .venv activated (seconds each)
    <!-- commands: slow -->                the same, in the `extended` test pass (minutes)
    <!-- commands: test: PATH::NAME -->    a dedicated test drives it from this text (e.g. in a demo-like layout)
    <!-- commands: overrides -->           each line is a set of trainer key=value overrides: they must load
    <!-- commands: gpu -->                 needs a GPU box or its models
    <!-- commands: manual: WHY -->         not run by CI, for the reason given (a long training run, a server)

tests/test_readme_recipes.py checks every block is marked, runs the `run`/`slow` ones and prints the rest;
`python -m tests.helpers.doc_blocks` prints the list of blocks CI does not run.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMMAND_LANGUAGES = ("bash", "sh", "shell", "console", "python")
KINDS = ("run", "slow", "test", "overrides", "gpu", "manual")
MARKER = re.compile(r"^<!--\s*commands:\s*(?P<kind>[a-z]+)\s*(?::\s*(?P<note>.*?))?\s*-->$")
FENCE = re.compile(r"^```(?P<language>[A-Za-z]*)\s*$")


@dataclass(frozen=True)
class DocBlock:
    """One fenced block: where it is (path relative to the repository, 1-based line of its opening fence), its
    language, its marker's kind and note (kind None: unmarked) and its text."""

    path: str
    line: int
    language: str
    kind: str | None
    note: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    def commands(self) -> list[str]:
        """Its commands: backslash continuations joined, blank and comment-only lines dropped."""
        joined = re.sub(r"\\\n", " ", self.text)
        return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def doc_files(repo: Path = REPO) -> list[Path]:
    """README.md and every docs/*.md."""
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def parse_blocks(text: str, path: str) -> list[DocBlock]:
    """Every fenced block of a markdown `text` with its marker; ValueError naming `path:line` for a marker that is
    malformed, of an unknown kind, or not right before a command block."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        marker = MARKER.match(lines[i].strip()) if lines[i].strip().startswith("<!-- commands") else None
        if lines[i].strip().startswith("<!-- commands") and marker is None:
            raise ValueError(f"{path}:{i + 1}: malformed marker {lines[i].strip()!r} (see tests/helpers/doc_blocks.py)")
        if marker is not None:
            if marker["kind"] not in KINDS:
                raise ValueError(f"{path}:{i + 1}: unknown kind {marker['kind']!r}; one of {list(KINDS)}")
            following = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
            if following is None or following["language"] not in COMMAND_LANGUAGES:
                raise ValueError(f"{path}:{i + 1}: a marker must be the line right before a command block's fence")
        if fence is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"{path}:{i + 1}: unclosed fence")
        previous = MARKER.match(lines[i - 1].strip()) if i > 0 else None
        blocks.append(DocBlock(path, i + 1, fence["language"], previous["kind"] if previous else None,
                               (previous["note"] or "") if previous else "", "\n".join(lines[i + 1:end]) + "\n"))
        i = end + 1
    return blocks


def doc_blocks(repo: Path = REPO) -> list[DocBlock]:
    """The command blocks of every documentation file, in file order."""
    out = []
    for path in doc_files(repo):
        blocks = parse_blocks(path.read_text(encoding="utf-8"), str(path.relative_to(repo)))
        out += [b for b in blocks if b.language in COMMAND_LANGUAGES]
    return out


def block_driven_by(test_id: str, repo: Path = REPO) -> DocBlock:
    """The one block marked `<!-- commands: test: TEST_ID -->`."""
    matches = [b for b in doc_blocks(repo) if b.kind == "test" and b.note == test_id]
    if len(matches) != 1:
        raise LookupError(f"{len(matches)} blocks are marked 'test: {test_id}'")
    return matches[0]


def inventory(blocks: list[DocBlock]) -> str:
    """The blocks CI does not run (unmarked, `gpu`, `manual`), two lines each: where, kind and note; the first
    command. The others run (`run`, `slow`), are driven by a test (`test`) or are loaded (`overrides`)."""
    lines = []
    for b in blocks:
        if b.kind not in (None, "gpu", "manual"):
            continue
        lines.append(f"{b.where}: {b.kind or 'UNMARKED'}{': ' + b.note if b.note else ''}")
        lines.append(f"    {(b.commands() or [''])[0][:110]}")
    covered = {kind: sum(b.kind == kind for b in blocks) for kind in KINDS}
    return "\n".join(lines + [f"({', '.join(f'{n} {kind}' for kind, n in covered.items())} blocks)"])


if __name__ == "__main__":
    print(inventory(doc_blocks()))
    sys.exit(0)
