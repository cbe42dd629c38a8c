"""``model.use_shm`` (veRL's key): load a model directory from a copy in shared memory (``/dev/shm``).

The copy is made once per machine and content (its name carries a digest of the source's file names, sizes and
modification times, so a changed model gets a new copy); the first worker process to finish it renames it into
place, the others reuse it. Copies stay after the run for the next one: remove ``/dev/shm/sead_models`` to free
that memory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

SHM_ROOT = Path("/dev/shm/sead_models")


def _signature(source: Path) -> str:
    """A digest of the directory's path and of every file's relative name, size and modification time."""
    digest = hashlib.sha256(str(source).encode())
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        stat = file.stat()
        digest.update(f"{file.relative_to(source)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def _size(source: Path) -> int:
    return sum(p.stat().st_size for p in source.rglob("*") if p.is_file())


def shm_model_dir(path: str | os.PathLike, root: Path | None = None) -> str:
    """The shared-memory copy of the model directory ``path`` (made now unless it exists); raises naming the key
    when ``path`` is no directory or the shared memory cannot hold it."""
    source = Path(path).resolve()
    if not source.is_dir():
        raise FileNotFoundError(f"model.use_shm: {path!r} is not a local directory")
    root = root or SHM_ROOT
    target = root / f"{source.name}-{_signature(source)}"
    if target.is_dir():
        return str(target)
    root.mkdir(parents=True, exist_ok=True)
    needed, free = _size(source), shutil.disk_usage(root).free
    if needed > free:
        raise OSError(f"model.use_shm: {source} needs {needed / 2**30:.1f} GiB, {root} has {free / 2**30:.1f} GiB "
                      "free; set use_shm=false")
    partial = root / f".{target.name}.{os.getpid()}.partial"
    shutil.copytree(source, partial)
    try:
        partial.rename(target)
        logger.info("model.use_shm: copied %s (%.1f MiB) to %s", source, needed / 2**20, target)
    except OSError:  # another process renamed its copy first
        shutil.rmtree(partial, ignore_errors=True)
    return str(target)


def model_dir(path: str, use_shm: bool) -> str:
    """``path`` itself, or with ``use_shm`` its shared-memory copy."""
    return shm_model_dir(path) if use_shm else path
