"""Checkpoint manifests: the SHA-256 and size of every file a checkpoint directory holds, written when it is saved
and verified before a reader opens it (docs/checkpoints.md says what that guarantees and what it does not).

``checkpoint_manifest.json`` in a directory lists every regular file under it, except that a subdirectory with a
manifest of its own is listed by that manifest file alone (a ``global_step_N/`` lists ``actor/``'s manifest, which
lists the actor's files), so a step is hashed once. Verifying a directory checks each listed file's size and hash,
recursing into listed manifests, and refuses a file the manifest does not list, a symbolic link and a path
leaving the directory. A directory without a manifest (a checkpoint from elsewhere, or from before manifests) is
refused unless the caller passes ``trust_unverified`` (the commands' documented "I trust this" flags). The
manifest proves a checkpoint unchanged since it was written, not who wrote it: the readers of its pickled parts
(:mod:`verl.utils.safe_dcp`, ``torch.load(weights_only=True)``) run no code whatever the manifest says.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

from verl.utils.untrusted import UntrustedInputError, load_json

logger = logging.getLogger(__name__)

__all__ = ["MANIFEST_FILE", "CheckpointTrustError", "FileDigest", "hash_files", "manifest_digest", "manifest_files",
           "verify_checkpoint", "write_manifest"]

MANIFEST_FILE = "checkpoint_manifest.json"
FORMAT = "sead-checkpoint-manifest/1"
MAX_MANIFEST_BYTES = 64 << 20  # ~150 bytes a file: hundreds of thousands of files
_CHUNK = 1 << 22
_HASH_THREADS = max(1, min(8, os.cpu_count() or 1))  # hashlib releases the GIL: files hash in parallel

FileDigest = tuple[str, int]  # (sha256 hex, size in bytes)


class CheckpointTrustError(ValueError):
    """A checkpoint that may not be opened: no manifest (without the trust flag), or files that differ from it.
    The message is one line naming the directory and the first problem."""


def _hash_file(path: Path) -> FileDigest:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def hash_files(root: str | os.PathLike, names: Iterable[str]) -> dict[str, FileDigest]:
    """{name: (sha256, size)} of the files `names` (paths relative to `root`), hashed on a few threads."""
    names, root = list(names), Path(root)
    with ThreadPoolExecutor(max_workers=_HASH_THREADS) as pool:
        return dict(zip(names, pool.map(lambda name: _hash_file(root / name), names)))


def manifest_files(directory: str | os.PathLike) -> list[str]:
    """The files a manifest of `directory` lists, relative and sorted: every regular file, a subdirectory holding
    its own manifest as that manifest alone. ValueError on a symbolic link or anything but files and
    directories (a checkpoint is written without them)."""
    root = Path(directory)
    found: list[str] = []

    def walk(current: Path) -> None:
        for entry in sorted(os.scandir(current), key=lambda e: e.name):
            path = Path(entry.path)
            rel = path.relative_to(root).as_posix()
            if entry.is_symlink():
                raise ValueError(f"{path} is a symbolic link; a checkpoint holds none")
            if entry.is_dir(follow_symlinks=False):
                if (path / MANIFEST_FILE).is_file():
                    found.append(f"{rel}/{MANIFEST_FILE}")
                else:
                    walk(path)
            elif entry.is_file(follow_symlinks=False):
                if current != root or entry.name != MANIFEST_FILE:
                    found.append(rel)
            else:
                raise ValueError(f"{path} is neither a file nor a directory")

    walk(root)
    return found


def write_manifest(directory: str | os.PathLike, digests: Mapping[str, FileDigest] | None = None) -> str:
    """Write `directory`/checkpoint_manifest.json listing :func:`manifest_files` (with `digests` computed
    elsewhere, e.g. by several ranks, else hashed here) and return the manifest's own SHA-256."""
    root = Path(directory)
    names = manifest_files(root)
    digests = dict(digests) if digests is not None else hash_files(root, names)
    missing = sorted(set(names) - set(digests))
    if missing:
        raise ValueError(f"no digest for {missing[:3]} of {root}")
    body = {"format": FORMAT, "algorithm": "sha256",
            "files": {name: {"sha256": digests[name][0], "bytes": digests[name][1]} for name in names}}
    data = (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()
    tmp = root / f".{MANIFEST_FILE}.tmp{os.getpid()}"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, root / MANIFEST_FILE)
    return hashlib.sha256(data).hexdigest()


def manifest_digest(directory: str | os.PathLike) -> str | None:
    """The SHA-256 of `directory`'s manifest file (None without one)."""
    path = Path(directory) / MANIFEST_FILE
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def _listed(directory: Path, data: bytes) -> dict[str, FileDigest]:
    """{relative path: (sha256, size)} of a manifest's bytes; CheckpointTrustError when it is not one."""
    where = directory / MANIFEST_FILE
    try:
        body = load_json(data, what=str(where), max_bytes=MAX_MANIFEST_BYTES)
    except UntrustedInputError as exc:
        raise CheckpointTrustError(f"unreadable manifest {exc}") from None
    files = body.get("files") if isinstance(body, dict) else None
    if not isinstance(body, dict) or body.get("format") != FORMAT or not isinstance(files, dict):
        raise CheckpointTrustError(f"{where} is not a checkpoint manifest ({FORMAT})")
    listed = {}
    for name, entry in files.items():
        parts = PurePosixPath(name).parts
        if (not name or name.startswith("/") or "\\" in name or any(p in ("", ".", "..") for p in parts)
                or PurePosixPath(name).as_posix() != name):
            raise CheckpointTrustError(f"{where} lists {name[:200]!r}, a path outside the checkpoint")
        sha, size = (entry.get("sha256"), entry.get("bytes")) if isinstance(entry, dict) else (None, None)
        if (not isinstance(sha, str) or len(sha) != 64 or isinstance(size, bool) or not isinstance(size, int)
                or size < 0):
            raise CheckpointTrustError(f"{where}: the entry of {name[:200]!r} is not a sha256 and a size")
        listed[name] = (sha, size)
    return listed


def _verify(directory: Path, data: bytes, expected_digest: str | None) -> int:
    """Check `directory` against its manifest's bytes `data`; returns the number of files verified."""
    if expected_digest is not None and hashlib.sha256(data).hexdigest() != expected_digest:
        raise CheckpointTrustError(f"{directory / MANIFEST_FILE} is not the manifest this checkpoint was saved "
                                   "with (its SHA-256 differs from the one recorded)")
    listed = _listed(directory, data)
    try:
        present = manifest_files(directory)
    except (ValueError, OSError) as exc:
        raise CheckpointTrustError(f"checkpoint {directory}: {exc}") from None
    unlisted = sorted(set(present) - set(listed))
    if unlisted:
        raise CheckpointTrustError(f"checkpoint {directory} holds {unlisted[0]}, which its manifest does not list "
                                   f"({len(unlisted)} such file(s)): it was changed after it was saved")
    for name, (_, size) in listed.items():
        path = directory / name
        try:
            info = os.lstat(path)
        except OSError:
            raise CheckpointTrustError(f"checkpoint {directory} lacks {name}, which its manifest lists") from None
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointTrustError(f"checkpoint {directory}: {name} is not a regular file")
        if info.st_size != size:
            raise CheckpointTrustError(f"checkpoint {directory}: {name} has {info.st_size} bytes, its manifest "
                                       f"says {size}: the file is truncated or was changed after the save")
    actual = hash_files(directory, listed)
    for name, (sha, _) in listed.items():
        if actual[name][0] != sha:
            raise CheckpointTrustError(f"checkpoint {directory}: {name} does not match its manifest's SHA-256 "
                                       "(corrupted or changed after the save)")
    count = len(listed)
    for name in listed:
        if PurePosixPath(name).name == MANIFEST_FILE:  # its bytes were just verified: now what it lists
            sub = directory / PurePosixPath(name).parent
            count += _verify(sub, (directory / name).read_bytes(), actual[name][0])
    return count


def verify_checkpoint(directory: str | os.PathLike, trust_unverified: bool = False, flag: str = "",
                      expected_digest: str | None = None) -> bool:
    """Verify checkpoint `directory` against its manifest (see the module docstring); True when it was verified,
    False when it has no manifest and `trust_unverified` lets it be opened anyway (with a warning).
    `expected_digest`: the manifest's SHA-256 recorded elsewhere (the run's own record), checked too.
    CheckpointTrustError otherwise; `flag` names the option that trusts a checkpoint without a manifest."""
    root = Path(directory)
    path = root / MANIFEST_FILE
    if not path.is_file() or path.is_symlink():
        if not root.is_dir():
            raise CheckpointTrustError(f"checkpoint {root} is not a directory")
        if expected_digest is not None:
            raise CheckpointTrustError(f"checkpoint {root} has no {MANIFEST_FILE}, but the run that wrote it recorded "
                                       "one: it was removed after the save")
        if trust_unverified:
            logger.warning("opening checkpoint %s without a manifest (%s given): its files are not verified", root,
                           flag or "trusted")
            return False
        raise CheckpointTrustError(
            f"checkpoint {root} has no {MANIFEST_FILE} (written with every checkpoint this project saves), so "
            f"nothing vouches for its files; if you trust where it came from, pass {flag or 'the trust flag'}")
    with open(path, "rb") as fh:
        data = fh.read(MAX_MANIFEST_BYTES + 1)
    count = _verify(root, data, expected_digest)
    logger.info("checkpoint %s: %d files match its manifest", root, count)
    return True
