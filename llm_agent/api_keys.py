"""API keys of the services the project calls (user simulators, an agent endpoint), read so that a key never
reaches a command line (every local user can read /proc/PID/cmdline), a file the project writes, an error message
or a log: from an environment variable, or from a file that only its owner, who must be the caller, can read or
write (mode 0600). Every message here names the file or the variable, never the key.
"""
from __future__ import annotations

import argparse
import os
import stat
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["MAX_KEY_CHARS", "ApiKeyError", "KeySafeArgumentParser", "api_key", "command_line_refusal",
           "read_key_file"]

MAX_KEY_CHARS = 16384  # far above any service's key; a larger file is not read whole


class ApiKeyError(ValueError):
    """A key file that cannot be used (missing, not ours, readable by others, empty); the message says why."""


def read_key_file(path: str | os.PathLike, option: str = "--api-key-file") -> str:
    """The key held in `path` (surrounding whitespace removed). ApiKeyError naming `option` unless it is a regular
    file, not a symbolic link, owned by the caller, with no group or other permission, not empty, at most
    MAX_KEY_CHARS long and one line without control characters (a key alone, not a file of several values). The
    message never repeats `path`: a key pasted where its file's path belongs must not reach the terminal."""
    given = f"the file given to {option}"
    try:
        # O_NONBLOCK: opening a FIFO does not wait for a writer (it is then refused as not a regular file)
        fd = os.open(os.fspath(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (OSError, ValueError) as err:  # ValueError: a NUL in the path
        raise ApiKeyError(f"{option}: cannot open {given} ({getattr(err, 'strerror', None) or 'invalid path'}; "
                          "the path is not repeated in case it is a key)") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):  # checked on the descriptor: a directory cannot even be wrapped in a file
        os.close(fd)
        raise ApiKeyError(f"{option}: {given} is not a regular file")
    with os.fdopen(fd, "r", encoding="utf-8") as fh:
        if info.st_uid != os.getuid():
            raise ApiKeyError(f"{option}: {given} is owned by uid {info.st_uid}, not by you")
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ApiKeyError(f"{option}: {given} has mode {stat.S_IMODE(info.st_mode):04o}; other users may read "
                              "it: chmod 600 it")
        try:
            key = fh.read(MAX_KEY_CHARS + 1)
        except UnicodeDecodeError:
            raise ApiKeyError(f"{option}: {given} is not UTF-8 text") from None
    if len(key) > MAX_KEY_CHARS:
        raise ApiKeyError(f"{option}: {given} holds more than {MAX_KEY_CHARS} characters: not a key file")
    key = key.strip()
    if not key:
        raise ApiKeyError(f"{option}: {given} is empty")
    if not key.isprintable():
        raise ApiKeyError(f"{option}: {given} holds several lines or control characters: a key file holds one key "
                          "on one line")
    return key


def api_key(env_var: str, path: str | os.PathLike | None = None, option: str = "--api-key-file",
            environ: Mapping[str, str] | None = None) -> str | None:
    """The key from `path` when given (see `read_key_file`), else from the environment variable `env_var`; None
    when neither is set."""
    if path is not None:
        return read_key_file(path, option)
    return (os.environ if environ is None else environ).get(env_var, "").strip() or None


def command_line_refusal(flag: str, env_var: str) -> str:
    """The message refusing a key passed as `flag KEY` on the command line (it never repeats the key)."""
    return (f"{flag} is not accepted: a command line is visible to every local user in /proc/PID/cmdline; set "
            f"{env_var} or pass {flag}-file PATH (mode 0600)")


class KeySafeArgumentParser(argparse.ArgumentParser):
    """The parser of a command that refuses keys on its command line: no abbreviated options (`--sim-api-key-f`
    would otherwise reach a flag the refusal does not watch), and arguments it does not know are reported by
    option name only, never by value (the value may be a key)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            names = sorted({arg.split("=", 1)[0] for arg in extras if arg.startswith("-")})
            shown = f"unrecognized option(s) {' '.join(names)}" if names else "unrecognized argument(s)"
            self.error(f"{shown} ({len(extras)} argument(s); values are not repeated, as one may be a key)")
        return parsed
