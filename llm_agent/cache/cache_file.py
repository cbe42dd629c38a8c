"""File mechanics of the response cache: line reading, atomic rewrites, the one-writer lock and the `.rejected`
side file.

- :func:`read_lines` reads a file line by line, never holding more than `max_line_bytes` of one line: a longer line
  is reported by its place in the file, not read into memory.
- :func:`atomic_write` replaces a file through a temp file in the same directory (fsync, rename, fsync dir).
- :class:`CacheFileLock` holds an exclusive ``fcntl.flock`` on ``<path>.lock`` for as long as a cache uses the
  file: a second process that opens the same cache file gets :class:`CacheLockedError` naming the holder, instead
  of silently dropping the other writer's lines at its next compaction. Caches of one process share the lock.
- :func:`keep_rejected` appends lines that cannot be read (corrupt, too long, another schema version, another
  encoding) byte for byte to ``<path>.rejected``, copied from the cache file in chunks, before a compaction drops
  them from it, so nothing is lost.
- :class:`CacheWriter` does a cache's appends (:func:`append_lines`) and rewrites (:func:`atomic_write`) on one
  background thread, in the order they were asked for, so that no disk write (and no fsync) runs on the thread
  that asked: the rollout loop's event loop stays free for every other dialogue. ``wait()`` returns once every
  write asked for before it is on disk (as far as each kind of write goes: appends reach the OS, rewrites are
  fsynced) and raises the first write error since the last wait.
"""
from __future__ import annotations

import fcntl
import logging
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

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


def append_lines(path: str, lines: Sequence[str]) -> None:
    """Append `lines` (each with a newline) to `path` in one write, creating its directory."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))


class CacheWriter:
    """One background thread writing a cache file in the order asked, shared (reference counted) by the caches of
    this process on that file, so a cache opened on it reads what another one queued (see the module docstring)."""

    _shared: dict[str, tuple["CacheWriter", int]] = {}  # real path -> (writer, holders)
    _guard = threading.Lock()

    def __init__(self, path: str) -> None:
        self.path = path
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], threading.Event | None] | None] = \
            queue.SimpleQueue()
        self._errors: list[BaseException] = []
        self._error_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="cache-writer", daemon=True)
        self._thread.start()

    @classmethod
    def acquire(cls, path: str) -> "CacheWriter":
        """The writer of `path` (started for the first holder)."""
        key = os.path.realpath(path)
        with cls._guard:
            writer, holders = cls._shared.get(key, (None, 0))
            if writer is None:
                writer = cls(path)
            cls._shared[key] = (writer, holders + 1)
            return writer

    def release(self) -> None:
        """Finish the queued writes; the last holder stops the thread (raises as `wait`)."""
        key = os.path.realpath(self.path)
        with self._guard:
            writer, holders = self._shared[key]
            if holders > 1:
                self._shared[key] = (writer, holders - 1)
            else:
                del self._shared[key]
        try:
            self.wait()
        finally:
            if holders <= 1:
                self._queue.put(None)
                self._thread.join()

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            write, done = job
            try:
                write()
            except BaseException as exc:  # kept for the next check: the asker has moved on
                logger.error("cache file %s: a background write failed: %r", self.path, exc)
                with self._error_lock:
                    self._errors.append(exc)
            finally:
                if done is not None:
                    done.set()

    def append(self, lines: Sequence[str]) -> None:
        """Queue appending `lines` to the file."""
        lines = list(lines)
        self._queue.put((lambda: append_lines(self.path, lines), None))

    def rewrite(self, lines: Sequence[str]) -> None:
        """Queue replacing the file by `lines` (atomically, fsynced)."""
        lines = list(lines)
        self._queue.put((lambda: atomic_write(self.path, lines), None))

    def check(self) -> None:
        """Raise (OSError naming the file) the first write that failed since the last check, without waiting."""
        with self._error_lock:
            errors, self._errors = self._errors, []
        if errors:
            raise OSError(f"cache file {self.path}: a background write failed: {errors[0]}") from errors[0]

    def wait(self) -> None:
        """Block until every write queued so far is done, then `check`."""
        done = threading.Event()
        self._queue.put((lambda: None, done))
        done.wait()
        self.check()


@dataclass(frozen=True)
class Line:
    """One line of a file: its number (from 1), where it starts, its length without the newline, its bytes (None
    when it is longer than the reader's limit) and whether a newline ends it (only the last line may lack one)."""

    number: int
    offset: int
    length: int
    raw: bytes | None
    complete: bool


def read_lines(path: str, max_line_bytes: int, chunk: int = 1 << 16) -> Iterator[Line]:
    """The lines of `path` in order; a line longer than `max_line_bytes` comes with `raw=None`, skipped in chunks."""
    with open(path, "rb") as f:
        number = offset = 0
        while raw := f.readline(max_line_bytes + 1):
            number += 1
            complete = raw.endswith(b"\n")
            length = len(raw) - complete
            if complete or length <= max_line_bytes:
                yield Line(number, offset, length, raw[:length], complete)
                offset += len(raw)
                continue
            while not complete and (rest := f.readline(chunk)):
                complete = rest.endswith(b"\n")
                length += len(rest) - complete
            yield Line(number, offset, length, None, complete)
            offset += length + complete


def keep_rejected(path: str, lines: Sequence[Line]) -> str:
    """Append `lines` of the file at `path` unchanged (each with a newline) to ``path + '.rejected'``, copied from
    `path` in chunks, fsynced; return its path."""
    target = path + REJECTED_SUFFIX
    with open(path, "rb") as source, open(target, "ab") as f:
        for line in lines:
            source.seek(line.offset)
            shutil.copyfileobj(_Span(source, line.length), f)
            f.write(b"\n")
        f.flush()
        os.fsync(f.fileno())
    return target


class _Span:
    """The next `length` bytes of a binary file as a readable object (for `shutil.copyfileobj`)."""

    def __init__(self, source, length: int) -> None:
        self.source, self.left = source, length

    def read(self, size: int = -1) -> bytes:
        size = self.left if size < 0 else min(size, self.left)
        data = self.source.read(size)
        self.left -= len(data)
        return data


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
