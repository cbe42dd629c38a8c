"""A key of a command's arguments that survives moving or copying the checkout: every argument that names an
existing file or directory stands for its content (SHA-256, `verl.utils.content_digest.path_digest`), and the
value of an output flag (`--out`) for nothing, so only what the command reads decides whether its earlier output
is still up to date (scripts/main.sh: the demo's warm start).

    python -m utils.content_key --output-flag=--out -- --model outputs/models/x/tiny_model --out ... --lr 3e-3
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from verl.utils.content_digest import path_digest


def content_key(args: Sequence[str], output_flags: Sequence[str] = ()) -> list[str]:
    """One line per argument: the argument itself, `<content sha256 ...>` for an existing path, `<output>` for the
    value of an output flag."""
    lines, skip_next = [], False
    for arg in args:
        if skip_next:
            lines.append("<output>")
            skip_next = False
        elif arg in output_flags:
            lines.append(arg)
            skip_next = True
        elif _is_path(arg):
            lines.append(f"<{'directory' if Path(arg).is_dir() else 'file'} sha256 {path_digest(arg)}>")
        else:
            lines.append(arg)
    return lines


def _is_path(arg: str) -> bool:
    try:
        return bool(arg) and Path(arg).exists()
    except (OSError, ValueError):  # not a name the file system takes (too long, a NUL byte): a plain value
        return False


def main(argv: list[str] | None = None) -> int:
    """Print the key, one line per argument."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-flag", action="append", default=[], help="a flag whose value is an output path")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then the command's arguments")
    parsed = parser.parse_args(argv)
    args = parsed.args[1:] if parsed.args[:1] == ["--"] else parsed.args
    print("\n".join(content_key(args, parsed.output_flag)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
