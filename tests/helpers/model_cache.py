"""The tests' tiny and warm-started models, built once and kept under outputs/test_cache/ (or $SEAD_TEST_CACHE),
keyed by everything that produced them, so that the two `make test` passes (.venv and .venv-vllm) and later runs
share them instead of each building its own.

The key hashes the sources that build a model (utils/, llm_agent/, the scenario files and assets), the recipe's
arguments and the torch version; changing any of them builds anew. A model is written to a temporary directory
and renamed into place when complete (under a lock, so concurrent sessions build it once), and its files are made
read-only so that a test writing into a shared model fails instead of changing it for the others.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.helpers.repo import REPO

CACHE_ROOT = Path(os.environ.get("SEAD_TEST_CACHE") or REPO / "outputs" / "test_cache")
PRODUCER_GLOBS = ("utils/*.py", "llm_agent/**/*.py", "verl/trainer/config/format_prompt/*.yaml", "assets/*")
STALE_AFTER_S = 24 * 3600
_COMPLETE = ".complete"


def producer_key(**recipe: object) -> str:
    """A hex digest of the model-building sources, the torch version and `recipe` (JSON-serialisable)."""
    import torch

    digest = hashlib.sha256(json.dumps({"recipe": recipe, "torch": torch.__version__}, sort_keys=True).encode())
    for pattern in PRODUCER_GLOBS:
        for path in sorted(REPO.glob(pattern)):
            if path.is_file():
                digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:20]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _writable(tree: Path) -> None:
    for path in [tree, *tree.rglob("*")]:
        with contextlib.suppress(OSError):
            path.chmod(path.stat().st_mode | stat.S_IWUSR)


def _read_only(tree: Path) -> None:
    for path in [*tree.rglob("*"), tree]:
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def _remove(tree: Path) -> None:
    _writable(tree)
    shutil.rmtree(tree, ignore_errors=True)


def cached_model(name: str, key: str, build: Callable[[Path], object]) -> Path:
    """`CACHE_ROOT/<name>-<key>`, calling `build(directory)` to fill it the first time. Directories of `name` under
    other keys, built more than a day ago, are removed then."""
    CACHE_ROOT.mkdir(parents=True, exist_ok=True)
    final = CACHE_ROOT / f"{name}-{key}"
    if (final / _COMPLETE).exists():
        return final
    with _locked(CACHE_ROOT / f"{name}.lock"):
        if (final / _COMPLETE).exists():
            return final
        for old in CACHE_ROOT.glob(f"{name}-*"):
            if old != final and (not (old / _COMPLETE).exists() or time.time() - old.stat().st_mtime > STALE_AFTER_S):
                _remove(old)
        building = CACHE_ROOT / f".{name}-{key}.building"
        _remove(building)
        building.mkdir()
        build(building)
        (building / _COMPLETE).write_text(key + "\n")
        _read_only(building)
        building.rename(final)
    return final
