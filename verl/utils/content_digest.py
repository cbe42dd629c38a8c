"""Digests of files and directories by content, never by path or modification time, so that moving or copying a
checkout keeps them: :func:`path_digest` (every byte, for small inputs) and :func:`model_fingerprint` (a model
directory's config and weight files, the weights sampled so that a 14B model costs milliseconds)."""
from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["WEIGHT_SUFFIXES", "model_fingerprint", "path_digest"]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
SAMPLE_BYTES = 1 << 20  # per sample of a weight file: its start, middle and end


def _update_file(digest: "hashlib._Hash", path: Path) -> None:
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)


def path_digest(path: str | Path) -> str:
    """SHA-256 of a file's bytes, or of a directory's files (relative names and bytes, in sorted order)."""
    root = Path(path)
    digest = hashlib.sha256()
    if root.is_file():
        _update_file(digest, root)
        return digest.hexdigest()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(root)).encode() + b"\0")
        _update_file(digest, file)
        digest.update(b"\0")
    return digest.hexdigest()


def _sampled(digest: "hashlib._Hash", path: Path) -> None:
    size = path.stat().st_size
    digest.update(f"{path.name}\0{size}\0".encode())
    with open(path, "rb") as f:
        if size <= 3 * SAMPLE_BYTES:
            digest.update(f.read())
            return
        for offset in (0, (size - SAMPLE_BYTES) // 2, size - SAMPLE_BYTES):
            f.seek(offset)
            digest.update(f.read(SAMPLE_BYTES))


def model_fingerprint(model_dir: str | Path) -> str | None:
    """SHA-256 of a Hugging Face model directory's ``config.json`` and its weight files (name, size and three 1 MiB
    samples each; the whole file when smaller): another build of the model (other weights) gives another
    fingerprint, a copy elsewhere the same one. None when the directory holds no weight file."""
    root = Path(model_dir)
    weights = sorted(p for p in root.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES) \
        if root.is_dir() else []
    if not weights:
        return None
    digest = hashlib.sha256()
    if (root / "config.json").is_file():
        _sampled(digest, root / "config.json")
    for path in weights:
        _sampled(digest, path)
    return digest.hexdigest()
