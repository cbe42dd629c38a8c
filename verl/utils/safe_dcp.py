"""torch.distributed.checkpoint directories read without running code from them, within what the files hold.

DCP's ``.metadata`` is a pickle, and its default load planner unpickles non-tensor items (optimizer settings) with
``weights_only=False``: both run whatever code the writer chose. :class:`SafeFileSystemReader` parses
``.metadata`` with an unpickler that can only build the classes DCP's metadata is made of (its dataclasses,
``torch.Size``, dtypes, the layout lookup, paths, the members of its enums by value or by name) and checks what it read against the directory before anything
is allocated or read: storage items in plain files of the directory (no ``../``, no links, no transforms),
within their sizes and not overlapping, each a stored (uncompressed) zip archive, tensors tiled by their chunks
with every chunk's bytes present on disk. So a tensor can claim no more memory than the checkpoint's files hold,
and the checks cost one pass over the metadata and each item's zip directory.
:class:`SafeLoadPlanner` reads the non-tensor items with ``torch.load(weights_only=True)``; tensors are read by
torch with ``weights_only=True`` already. Anything refused is a :class:`CheckpointFormatError`, one line.
"""
from __future__ import annotations

import enum
import importlib
import io
import math
import os
import pickle
import re
import stat
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorStorageMetadata)

__all__ = ["METADATA_FILE", "CheckpointFormatError", "SafeFileSystemReader", "SafeLoadPlanner", "load_dcp",
           "read_dcp_metadata"]

METADATA_FILE = ".metadata"  # DCP's file name for the checkpoint's metadata
MAX_METADATA_BYTES = 256 << 20  # a 70B model on 64 ranks: tens of MB
MAX_DIMS = 64
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")
_DCP = "torch.distributed.checkpoint"
# the globals a DCP metadata pickle refers to (module, name); nothing else is ever looked up
_ALLOWED = {(f"{_DCP}.metadata", name) for name in (
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
    "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    (f"{_DCP}.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
    *((module, name) for module in ("pathlib", "pathlib._local")
      for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"))}
_STORAGE_INFO = (f"{_DCP}.filesystem", "_StorageInfo")


class CheckpointFormatError(ValueError):
    """A DCP directory refused: metadata that is not DCP's (or refers to code), or that the files contradict."""


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only the allowed globals (module docstring); any other reference is refused, not imported."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(importlib.import_module(module), name)
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        raise CheckpointFormatError(f"refers to {module[:100]}.{name[:100]}, which DCP metadata never holds")

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointFormatError("holds a persistent reference, which DCP metadata never does")


def _enum_member(cls: Any, name: Any) -> Any:
    """The `getattr(enum, name)` with which some Pythons (Debian's 3.11.2, say) pickle an enum member: only a member
    of an allowed enum (`_MEM_FORMAT_ENCODING`), by its name."""
    if not (isinstance(cls, enum.EnumMeta) and (cls.__module__, cls.__qualname__) in _ALLOWED
            and isinstance(name, str) and name in cls.__members__):
        raise CheckpointFormatError("looks up an attribute other than a member of DCP's enums, which DCP metadata "
                                    "never does")
    return cls[name]


class _Slice(io.RawIOBase):
    """A read-only, seekable view of `length` bytes at `offset` of an open file (for zipfile)."""

    def __init__(self, fh: Any, offset: int, length: int) -> None:
        self.fh, self.offset, self.length, self.pos = fh, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = max(0, {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence])
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        self.fh.seek(self.offset + self.pos)
        data = self.fh.read(n)
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)


def _dims(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, torch.Size) or len(value) > MAX_DIMS:
        raise CheckpointFormatError(f"{what} is not a torch.Size of at most {MAX_DIMS} dimensions")
    if any(d < 0 for d in value):
        raise CheckpointFormatError(f"{what} has a negative size")
    return tuple(value)


class _Validator:
    """The checks of the module docstring, on metadata read from `directory` (one pass, linear in its size)."""

    def __init__(self, directory: Path, metadata: Any) -> None:
        self.directory, self.metadata = directory, metadata
        self.file_sizes: dict[str, int] = {}
        self.storage_class = getattr(importlib.import_module(_STORAGE_INFO[0]), _STORAGE_INFO[1])

    def _file_size(self, name: Any) -> int:
        if name not in self.file_sizes:
            if not isinstance(name, str) or not _FILE_NAME.fullmatch(name) or name == METADATA_FILE:
                raise CheckpointFormatError(f"names the storage file {str(name)[:200]!r}, which is no plain file "
                                            "name inside the checkpoint directory")
            try:
                info = os.lstat(self.directory / name)
            except OSError:
                raise CheckpointFormatError(f"names the storage file {name}, which does not exist") from None
            if not stat.S_ISREG(info.st_mode):
                raise CheckpointFormatError(f"names the storage file {name}, which is not a regular file")
            self.file_sizes[name] = info.st_size
        return self.file_sizes[name]

    def _storage(self, key: MetadataIndex) -> Any:
        info = self.metadata.storage_data.get(key)
        if info is None:
            raise CheckpointFormatError(f"has no storage for {key.fqn[:200]!r} at {tuple(key.offset or ())}")
        return info

    def check(self) -> None:
        md = self.metadata
        if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict) \
                or not isinstance(md.storage_data, dict):
            raise CheckpointFormatError("is not DCP metadata (a Metadata with state_dict_metadata and storage_data)")
        if md.planner_data is not None and not isinstance(md.planner_data, dict):
            raise CheckpointFormatError("has planner data that is not a dict")
        for key, info in md.storage_data.items():
            if not isinstance(key, MetadataIndex) or not isinstance(key.fqn, str) or not isinstance(
                    info, self.storage_class):
                raise CheckpointFormatError("has a storage entry that is not a MetadataIndex and its storage info")
            size = self._file_size(info.relative_path)
            if info.transform_descriptors:
                raise CheckpointFormatError(f"stores {key.fqn[:200]!r} through transforms, which are not read")
            offset, length = info.offset, info.length
            if (any(isinstance(v, bool) or not isinstance(v, int) for v in (offset, length)) or offset < 0
                    or length < 0 or offset + length > size):
                raise CheckpointFormatError(f"places {key.fqn[:200]!r} at bytes {offset!r}+{length!r} of "
                                            f"{info.relative_path} ({size} bytes)")
        for fqn, meta in md.state_dict_metadata.items():
            if not isinstance(fqn, str):
                raise CheckpointFormatError("has a state-dict key that is not a string")
            if isinstance(meta, BytesStorageMetadata):
                self._storage(MetadataIndex(fqn))
            elif isinstance(meta, TensorStorageMetadata):
                self._tensor(fqn, meta)
            else:
                raise CheckpointFormatError(f"describes {fqn[:200]!r} as {type(meta).__name__}")
        self._archives()

    def _tensor(self, fqn: str, meta: TensorStorageMetadata) -> None:
        dtype = getattr(meta.properties, "dtype", None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointFormatError(f"gives {fqn[:200]!r} no dtype")
        size = _dims(meta.size, f"the size of {fqn[:200]!r}")
        if not isinstance(meta.chunks, list):
            raise CheckpointFormatError(f"gives {fqn[:200]!r} no chunk list")
        item = dtype.itemsize
        seen, covered = set(), 0
        for chunk in meta.chunks:
            if not isinstance(chunk, ChunkStorageMetadata):
                raise CheckpointFormatError(f"has a chunk of {fqn[:200]!r} that is not ChunkStorageMetadata")
            offsets = _dims(chunk.offsets, f"a chunk offset of {fqn[:200]!r}")
            sizes = _dims(chunk.sizes, f"a chunk size of {fqn[:200]!r}")
            if len(offsets) != len(size) or len(sizes) != len(size) or offsets in seen or any(
                    o + s > d for o, s, d in zip(offsets, sizes, size)):
                raise CheckpointFormatError(f"has a chunk of {fqn[:200]!r} outside its size {list(size)}")
            seen.add(offsets)
            numel = math.prod(sizes)
            info = self._storage(MetadataIndex(fqn, chunk.offsets))
            if numel * item > info.length:
                raise CheckpointFormatError(f"claims {numel} elements of {fqn[:200]!r} in {info.length} bytes of "
                                            f"{info.relative_path}")
            covered += numel
        if covered != math.prod(size):
            raise CheckpointFormatError(f"has chunks of {fqn[:200]!r} covering {covered} of its "
                                        f"{math.prod(size)} elements")

    def _archives(self) -> None:
        """Storage items do not overlap (so no byte is parsed or read twice), and each is a stored zip archive
        (torch.save's) no larger unpacked than its bytes."""
        by_file: dict[str, list[Any]] = {}
        for info in self.metadata.storage_data.values():
            by_file.setdefault(info.relative_path, []).append(info)
        for name, infos in by_file.items():
            infos.sort(key=lambda info: info.offset)
            for before, after in zip(infos, infos[1:]):
                if after.offset < before.offset + max(before.length, 1):
                    raise CheckpointFormatError(f"has items overlapping at byte {after.offset} of {name}")
            with open(self.directory / name, "rb") as fh:
                for info in infos:
                    try:
                        with zipfile.ZipFile(_Slice(fh, info.offset, info.length)) as archive:
                            entries = archive.infolist()
                    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
                        raise CheckpointFormatError(f"has an item in {name} at byte {info.offset} that is not "
                                                    f"torch.save's archive ({exc})") from None
                    if any(e.compress_type != zipfile.ZIP_STORED for e in entries) or sum(
                            e.file_size for e in entries) > info.length:
                        raise CheckpointFormatError(f"has a compressed or oversized item in {name} at byte "
                                                    f"{info.offset}")


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file-system reader whose metadata is parsed and checked as the module docstring says (`metadata`:
    already read that way, e.g. by :func:`load_dcp`, which reads it before DCP can log a failure)."""

    def __init__(self, path: str | os.PathLike, metadata: Metadata | None = None) -> None:
        super().__init__(path)
        self._checked = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointFormatError("per-rank metadata files are not read")
        return self._checked if self._checked is not None else read_dcp_metadata(self.path)


class SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """The default load planner, reading non-tensor items with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            item = torch.load(value, map_location="cpu", weights_only=True)
        except Exception:  # noqa: BLE001  (weights_only refusals come as several exception types)
            raise CheckpointFormatError(f"item {read_item.dest_index.fqn[:200]!r} is no plain data (torch.load with "
                                        "weights_only=True refused it)") from None
        plain = io.BytesIO()
        torch.save(item, plain)  # plain data only, so the parent's own load of it builds the same plain data
        plain.seek(0)
        super().load_bytes(read_item, plain)


def read_dcp_metadata(directory: str | os.PathLike) -> Metadata:
    """The checked metadata of the DCP directory `directory` (CheckpointFormatError naming it otherwise)."""
    directory = Path(directory)
    path = directory / METADATA_FILE
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_METADATA_BYTES + 1)
    except OSError as exc:
        raise CheckpointFormatError(f"cannot read {path}: {exc.strerror}") from None
    if len(data) > MAX_METADATA_BYTES:
        raise CheckpointFormatError(f"{path} is over {MAX_METADATA_BYTES} bytes: not DCP metadata")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        _Validator(directory, metadata).check()
    except CheckpointFormatError as exc:
        raise CheckpointFormatError(f"{path} {exc}") from None
    except Exception as exc:  # noqa: BLE001  (a malformed pickle fails in many ways; none of them runs code)
        raise CheckpointFormatError(f"{path} is not DCP metadata ({type(exc).__name__}: "
                                    f"{str(exc).splitlines()[0][:200] if str(exc) else ''})") from None
    return metadata


def load_dcp(state: Mapping[str, Any], directory: str | os.PathLike,
             process_group: dist.ProcessGroup | None = None, alone: bool = False) -> None:
    """``dcp.load`` of `state` from `directory` with the safe reader and planner, by every rank of `process_group`
    (`alone`: in this process only); a refused or unreadable checkpoint is one CheckpointFormatError."""
    metadata = read_dcp_metadata(directory)  # on every rank: a refusal is the same everywhere, before any collective
    try:
        with warnings.catch_warnings():  # alone, DCP's "assuming a single process" is what was asked for
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=SafeFileSystemReader(str(directory), metadata), planner=SafeLoadPlanner(),
                     process_group=process_group, no_dist=alone)
    except CheckpointFormatError:
        raise
    except (Exception, dcp.CheckpointException) as exc:  # noqa: BLE001  (DCP wraps every rank's failure in one)
        text = str(exc)
        inner = re.search(r"CheckpointFormatError: ([^\n]*)", text)
        first = next((line for line in text.splitlines() if line.strip()), "")[:300]
        raise CheckpointFormatError(inner.group(1) if inner else
                                    f"cannot load {directory}: {type(exc).__name__}: {first}") from None
