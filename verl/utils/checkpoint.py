"""Atomic checkpoint directories, latest-step discovery, retention and the trainer's JSON state.

Layout under a checkpoint root (``trainer.default_local_dir``)::

    global_step_N/                      complete checkpoint (actor/, critic/, trainer_state.json,
                                        checkpoint_manifest.json)
    global_step_N.partial/              being written; ignored on resume and removed by the next run
    latest_checkpointed_iteration.txt   "N" of the checkpoint written last (veRL's tracker file)
    manifest_digests.json               {"global_step_N": SHA-256 of its manifest} of the checkpoints kept

A checkpoint is written into ``global_step_N.partial`` (:func:`begin_checkpoint`), and
:func:`commit_checkpoint` renames it to ``global_step_N`` once ``trainer_state.json`` is in it (the rename is
the commit point), then rewrites the tracker file via write-temp + ``os.replace`` and applies retention, which
never removes the checkpoint just written. Before the rename it writes the step's manifest
(:mod:`verl.utils.checkpoint_manifest`) and records its SHA-256 in the root's ``manifest_digests.json``: the run's
own record of what it wrote, outside the step directory (:func:`recorded_digest`). Every file and directory of the
checkpoint is fsynced before that rename, so after a power loss a committed checkpoint never holds torn weights.
A run killed at any moment therefore leaves either the previous or the new checkpoint as the latest complete one, and a checkpoint
whose ``trainer_state.json`` cannot be read is skipped on resume in favour of the newest valid one (with a
warning naming it). Re-saving an existing step first moves the old directory to
``global_step_N.replaced``; a kill between the two renames is repaired by :func:`remove_partial_checkpoints`,
which moves it back.
"""
from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch

from verl.utils.checkpoint_manifest import manifest_digest, write_manifest
from verl.utils.untrusted import UntrustedInputError, load_json

logger = logging.getLogger(__name__)

TRACKER_FILE = "latest_checkpointed_iteration.txt"
DIGESTS_FILE = "manifest_digests.json"
MAX_DIGESTS_BYTES = 16 << 20
STATE_FILE = "trainer_state.json"
MAX_STATE_BYTES = 256 << 20  # a trainer state is KBs to a few MB (controller and cache state included)
PARTIAL_SUFFIX = ".partial"
_STEP_RE = re.compile(r"^global_step_(\d+)$")
_PARTIAL_RE = re.compile(r"^global_step_(\d+)\.(partial|replaced)$")

PathLike = Union[str, os.PathLike]


def step_dir(root: PathLike, step: int) -> Path:
    """``root/global_step_{step}``."""
    return Path(root) / f"global_step_{int(step)}"


def step_of(path: PathLike) -> int:
    """The step N of a ``global_step_N`` directory; ValueError for any other name."""
    match = _STEP_RE.match(Path(path).name)
    if not match:
        raise ValueError(f"{path} is not a global_step_N checkpoint directory")
    return int(match.group(1))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(root: PathLike) -> None:
    """fsync every regular file under ``root``, then every directory bottom-up (``root`` last)."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(directory, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(directory))


def atomic_write_text(path: PathLike, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old or the new content, never a torn file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def remove_partial_checkpoints(root: PathLike) -> list[Path]:
    """Clean up after a killed save; return the directories deleted.

    ``global_step_N.partial`` directories are deleted. A ``global_step_N.replaced`` directory (the old copy of a
    step being re-saved) is moved back to ``global_step_N`` when the kill came before the new copy was renamed
    into place, and deleted otherwise.
    """
    root = Path(root)
    removed = []
    if root.is_dir():
        for child in sorted(root.iterdir()):
            match = _PARTIAL_RE.match(child.name)
            if not (child.is_dir() and match):
                continue
            final = step_dir(root, int(match.group(1)))
            if match.group(2) == "replaced" and not final.exists() and (child / STATE_FILE).is_file():
                os.replace(child, final)
                restored = manifest_digest(final)
                if restored is not None:  # the record may name the interrupted save's manifest
                    _record_digest(root, int(match.group(1)), restored)
                logger.warning("restored %s from %s (a re-save was interrupted)", final, child)
                continue
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    if removed:
        logger.warning("removed %d incomplete checkpoint directories under %s", len(removed), root)
    return removed


def begin_checkpoint(root: PathLike, step: int) -> Path:
    """Create an empty ``root/global_step_{step}.partial`` directory (replacing a stale one) and return it."""
    partial = Path(root) / f"global_step_{int(step)}{PARTIAL_SUFFIX}"
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    return partial


def list_checkpoints(root: PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` (``global_step_N`` holding trainer_state.json), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_RE.match(child.name)
        if match and child.is_dir() and (child / STATE_FILE).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def _tracked_step(root: Path) -> Optional[int]:
    tracker = root / TRACKER_FILE
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    return int(text) if text.isdigit() else None


def _check_minimal_state(directory: Path, state: dict[str, Any]) -> None:
    if not isinstance(state.get("global_step"), int):
        raise ValueError(f"{directory / STATE_FILE}: 'global_step' must be an integer, got "
                         f"{state.get('global_step')!r}")


StateCheck = Callable[[Path, dict[str, Any]], None]


def find_latest_checkpoint(root: PathLike, check: Optional[StateCheck] = None) -> Optional[Path]:
    """The checkpoint to resume from under ``root``, or None; ``.partial`` directories are ignored.

    That is the step named by the tracker file when it is a complete checkpoint (the one the last run wrote,
    even if an older run left higher steps in the same directory), else the newest complete checkpoint (the
    tracker is missing, or the run was killed between the commit rename and the tracker update). A candidate
    whose trainer state cannot be read or fails ``check(directory, state)`` (default: an integer global_step;
    raising ValueError, e.g. files that differ from the checkpoint's manifest) is skipped with a warning naming it
    and why, and the next one is tried: older steps of the tracked run first, newest first.
    """
    root = Path(root)
    checkpoints = list_checkpoints(root)
    if not checkpoints:
        return None
    tracked = _tracked_step(root)
    steps = [step for step, _ in checkpoints]
    if tracked is not None and tracked not in steps:
        logger.warning("%s names step %d, which is not a complete checkpoint; using the newest valid one",
                       root / TRACKER_FILE, tracked)
        tracked = None
    anchor = tracked if tracked is not None else steps[-1]
    order = sorted(checkpoints, key=lambda item: (item[0] > anchor, -item[0]))
    check = check or _check_minimal_state
    skipped, first_reason = [], ""
    for step, path in order:
        try:
            check(path, load_trainer_state(path))
        except ValueError as exc:
            skipped.append(step)
            first_reason = first_reason or str(exc)
            logger.warning("skipping checkpoint %s: %s", path, exc)
            continue
        if skipped:
            logger.warning("resuming from %s instead of the unusable checkpoint(s) at step(s) %s", path, skipped)
        return path
    raise ValueError(f"no valid checkpoint under {root}: every one of steps {steps} was skipped (step {skipped[0]}: "
                     f"{first_reason}); move them away or set trainer.resume_mode=disable")


def apply_retention(root: PathLike, max_ckpt_to_keep: Optional[int], protect: Optional[int] = None) -> list[Path]:
    """Delete all but ``max_ckpt_to_keep`` complete checkpoints (None or <= 0 keeps all); return the deleted.

    Kept first is step ``protect`` (the checkpoint just written), then the run's own older steps, newest first;
    steps above ``protect`` can only be stale leftovers of an older run in the same directory, so they are the
    first to go (a resumed run never loses its own newer checkpoints to them).
    """
    if not max_ckpt_to_keep or max_ckpt_to_keep <= 0:
        return []
    checkpoints = list_checkpoints(root)
    if protect is None:
        ranked = sorted(checkpoints, key=lambda item: -item[0])
    else:
        ranked = sorted(checkpoints, key=lambda item: (item[0] != protect, item[0] > protect, -item[0]))
    doomed = [path for _, path in ranked[max_ckpt_to_keep:]]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
        stale = protect is not None and step_of(path) > protect
        logger.info("retention: removed %s%s", path, " (stale, from an older run)" if stale else "")
    if doomed:
        _write_digests(root, {name: digest for name, digest in _read_digests(root).items()
                              if name not in {path.name for path in doomed}})
    return doomed


def _read_digests(root: Path) -> dict[str, str]:
    """The root's record of manifest digests ({} when absent or unreadable: nothing is recorded then)."""
    path = Path(root) / DIGESTS_FILE
    try:
        record = load_json(path.read_bytes(), what=str(path), max_bytes=MAX_DIGESTS_BYTES)
    except FileNotFoundError:
        return {}
    except (OSError, UntrustedInputError) as exc:
        logger.warning("ignoring the manifest record %s: %s", path, exc)
        return {}
    return {k: v for k, v in record.items() if isinstance(v, str)} if isinstance(record, dict) else {}


def _write_digests(root: Path, digests: dict[str, str]) -> None:
    atomic_write_text(Path(root) / DIGESTS_FILE, json.dumps(digests, indent=1, sort_keys=True) + "\n")


def _record_digest(root: Path, step: int, digest: str) -> None:
    """Record `digest` as the manifest of ``global_step_{step}`` under `root` (before the commit rename)."""
    _write_digests(root, {**_read_digests(root), step_dir(root, step).name: digest})


def recorded_digest(checkpoint: PathLike) -> Optional[str]:
    """The manifest SHA-256 that the run writing into ``checkpoint``'s root recorded for it, or None."""
    checkpoint = Path(checkpoint)
    return _read_digests(checkpoint.parent).get(checkpoint.name)


def commit_checkpoint(root: PathLike, step: int, max_ckpt_to_keep: Optional[int] = None) -> Path:
    """Publish ``global_step_{step}.partial`` as ``global_step_{step}``, update the tracker, apply retention."""
    root = Path(root)
    partial = root / f"global_step_{int(step)}{PARTIAL_SUFFIX}"
    if not (partial / STATE_FILE).is_file():
        raise FileNotFoundError(f"{partial} has no {STATE_FILE}: the checkpoint is incomplete")
    _record_digest(root, step, write_manifest(partial))
    fsync_tree(partial)  # the data reaches the disk before the rename makes the checkpoint count as complete
    final = step_dir(root, step)
    replaced = None
    if final.exists():
        replaced = root / f"global_step_{int(step)}.replaced"
        if replaced.exists():
            shutil.rmtree(replaced)
        os.replace(final, replaced)
    os.replace(partial, final)
    _fsync_dir(root)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    atomic_write_text(root / TRACKER_FILE, f"{int(step)}\n")
    apply_retention(root, max_ckpt_to_keep, protect=int(step))
    return final


def _to_jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return _to_jsonable(value.tolist())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, torch.Tensor):
        return _to_jsonable(value.tolist())
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"trainer state value of type {type(value).__name__} is not JSON-serialisable: {value!r:.100}")


def save_trainer_state(directory: PathLike, state: dict[str, Any]) -> Path:
    """Write ``state`` (numpy/torch values become lists/numbers) to ``directory/trainer_state.json``; ValueError
    on a NaN or infinite value (a resume would refuse it)."""
    path = Path(directory) / STATE_FILE
    try:
        text = json.dumps(_to_jsonable(state), indent=1, sort_keys=True, allow_nan=False)
    except ValueError as exc:
        raise ValueError(f"trainer state for {path} holds a non-finite number: {exc}") from None
    atomic_write_text(path, text)
    return path


def load_trainer_state(directory: PathLike) -> dict[str, Any]:
    """Read ``directory/trainer_state.json`` (a JSON object, no NaN/Infinity, within the outside-input limits of
    :mod:`verl.utils.untrusted`); ValueError naming the file otherwise."""
    path = Path(directory) / STATE_FILE
    try:
        state = load_json(path.read_bytes(), what=f"the trainer state {path}", max_bytes=MAX_STATE_BYTES)
    except OSError as exc:
        raise ValueError(f"cannot read the trainer state {path}: {exc}") from exc
    except UntrustedInputError as exc:
        raise ValueError(f"cannot read {exc}") from None
    if not isinstance(state, dict):
        raise ValueError(f"the trainer state {path} must be a JSON object, got {type(state).__name__}")
    return state


def check_rng_state(state: Any) -> None:
    """Raise ValueError (saying which generator) unless ``state`` is restorable by :func:`set_rng_state`.

    Every part is loaded into a scratch generator, so nothing global changes.
    """
    if not isinstance(state, dict):
        raise ValueError(f"'rng' must be an object, got {type(state).__name__}")
    for key in ("python", "numpy", "torch"):
        if key not in state:
            raise ValueError(f"'rng' has no {key!r} state")
    try:
        version, py_state, gauss = state["python"]
        random.Random().setstate((version, tuple(py_state), gauss))
    except (TypeError, ValueError, IndexError) as exc:
        raise ValueError(f"'rng.python' is not a Python RNG state: {exc}") from None
    try:
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.RandomState().set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    except (TypeError, ValueError, OverflowError, IndexError) as exc:
        raise ValueError(f"'rng.numpy' is not a numpy RNG state: {exc}") from None
    try:
        torch.Generator().set_state(_bytes_tensor(state["torch"]))
    except (TypeError, ValueError, RuntimeError, binascii.Error) as exc:
        raise ValueError(f"'rng.torch' is not a torch RNG state: {exc}") from None


def get_rng_state() -> dict[str, Any]:
    """Python, numpy and torch (CPU and CUDA) RNG states as JSON-serialisable data."""
    py_version, py_state, py_gauss = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii"),
    }
    if torch.cuda.is_available():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode("ascii") for s in torch.cuda.get_rng_state_all()]
    return state


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore RNG states captured by :func:`get_rng_state`."""
    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_bytes_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_bytes_tensor(s) for s in state["cuda"]])
