"""File mechanics of the response cache: atomic rewrites, the one-writer lock and the `.rejected` side file.

- :func:`atomic_write` replaces a file through a temp file in the same directory (fsync, rename, fsync dir).
- :class:`CacheFileLock` holds an exclusive ``fcntl.flock`` on ``<path>.lock`` for as long as a cache uses the
  file: a second process that opens the same cache file gets :class:`CacheLockedError` naming the holder, instead
  of silently dropping the other writer's lines at its next compaction. Caches of one process share the lock.
- :func:`keep_rejected` appends lines that cannot be read (corrupt, another schema version, another encoding)
  byte for byte to ``<path>.rejected`` before a compaction drops them from the cache file, so nothing is lost.
"""
from __future__ import annotations

import fcntl
import os
import tempfile
import threading

LOCK_SUFFIX = ".lock"
REJECTED_SUFFIX = ".rejected"


class CacheLockedError(RuntimeError):
    """Another process holds the cache file's lock (one writer per cache file)."""


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, lines: list[str]) -> None:
    """Write `lines` to `path` through a temp file in the same directory, fsync and rename; on any error the
    temp file is removed, an existing file is left as it was, and the error propagates."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def keep_rejected(path: str, raw_lines: list[bytes]) -> str:
    """Append `raw_lines` (each without its newline) unchanged to ``path + '.rejected'``, fsynced; return its path."""
    target = path + REJECTED_SUFFIX
    with open(target, "ab") as f:
        f.write(b"".join(raw + b"\n" for raw in raw_lines))
        f.flush()
        os.fsync(f.fileno())
    return target


class CacheFileLock:
    """An exclusive lock on ``<path>.lock`` shared by every holder in this process (reference counted)."""

    _held: dict[str, tuple[int, int]] = {}  # real lock path -> (fd, holders)
    _guard = threading.Lock()

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.lock_path = os.path.realpath(path + LOCK_SUFFIX)
        self._released = False
        with self._guard:
            held = self._held.get(self.lock_path)
            if held is not None:
                self._held[self.lock_path] = (held[0], held[1] + 1)
                return
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise CacheLockedError(
                    f"cache file {path} is in use by another process (PID {holder} holds {self.lock_path}); "
                    f"one run writes a cache file: give this run its own cache path, or stop the other") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            self._held[self.lock_path] = (fd, 1)

    def release(self) -> None:
        """Drop this holder; the lock is released when the last holder in the process lets go (idempotent)."""
        with self._guard:
            if self._released:
                return
            self._released = True
            fd, holders = self._held[self.lock_path]
            if holders > 1:
                self._held[self.lock_path] = (fd, holders - 1)
                return
            del self._held[self.lock_path]
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
