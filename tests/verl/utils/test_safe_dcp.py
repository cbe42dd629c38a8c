"""torch.distributed.checkpoint directories are read without running code from them and within what their files
hold: a crafted `.metadata` or pickled item runs nothing (each payload is first shown to run under torch's own
reader), and metadata that lies about paths, sizes or chunks is refused before anything is allocated."""
from __future__ import annotations

import enum
import io
import pickle
import warnings
from pathlib import Path, PurePosixPath

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

from verl.utils.fsdp_utils import SHARDED_STATE_DIR, load_sharded_state, save_sharded_state
from verl.utils.safe_dcp import METADATA_FILE, CheckpointFormatError, load_dcp, read_dcp_metadata


class MarkerPayload:
    """Unpickling this creates the file `path` (the code a hostile checkpoint would run)."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.fixture(autouse=True)
def _quiet_single_process_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _save(directory: Path, state: dict) -> Path:
    dcp.save(state, checkpoint_id=str(directory), no_dist=True)
    return directory


def _state() -> dict:
    return {"model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(4)},
            "optim": {"lr": 0.5, "betas": (0.9, 0.99), "step": 3}}


def _rewrite_metadata(directory: Path, change) -> None:
    """Load our own (trusted) metadata with pickle, let `change` edit it, and write it back."""
    path = directory / METADATA_FILE
    metadata = pickle.loads(path.read_bytes())
    change(metadata)
    path.write_bytes(pickle.dumps(metadata))


def test_a_checkpoint_round_trips_tensors_and_plain_items(tmp_path):
    saved = _save(tmp_path / "ck", _state())
    state = {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(4)},
             "optim": {"lr": 0.0, "betas": (0.0, 0.0), "step": 0}}
    load_dcp(state, saved, alone=True)
    assert torch.equal(state["model"]["w"], _state()["model"]["w"]) and torch.equal(state["model"]["b"], torch.ones(4))
    assert state["optim"] == {"lr": 0.5, "betas": (0.9, 0.99), "step": 3}


def test_a_crafted_metadata_pickle_runs_nothing(tmp_path):
    saved = _save(tmp_path / "ck", _state())
    marker = tmp_path / "marker"
    (saved / METADATA_FILE).write_bytes(pickle.dumps(MarkerPayload(marker)))
    with pytest.raises(CheckpointFormatError) as err:
        read_dcp_metadata(saved)
    assert "refers to io.open" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(CheckpointFormatError):
        load_dcp({"model": {"w": torch.zeros(3, 4)}}, saved, alone=True)
    assert not marker.exists(), "no code of the checkpoint may run"
    dcp.FileSystemReader(str(saved)).read_metadata()  # the payload is real: torch's own reader runs it
    assert marker.exists()


def test_a_crafted_pickled_item_runs_nothing(tmp_path):
    marker = tmp_path / "marker"
    saved = _save(tmp_path / "ck", {"model": {"w": torch.ones(2)}, "optim": {"lr": MarkerPayload(marker)}})
    marker.unlink(missing_ok=True)  # saving pickles the payload without running it; be sure
    with pytest.raises(CheckpointFormatError, match="'optim.lr' is no plain data"):
        load_dcp({"model": {"w": torch.zeros(2)}, "optim": {"lr": 0.0}}, saved, alone=True)
    assert not marker.exists()
    dcp.load({"model": {"w": torch.zeros(2)}, "optim": {"lr": 0.0}}, checkpoint_id=str(saved), no_dist=True)
    assert marker.exists(), "the payload is real: torch's default planner runs it"


def test_the_resume_path_reads_a_hostile_sharded_state_without_running_it(tmp_path):
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    save_sharded_state(model, optimizer, tmp_path)
    restored = torch.nn.Linear(4, 3)
    load_sharded_state(restored, torch.optim.AdamW(restored.parameters(), lr=0.2), tmp_path)
    assert torch.equal(restored.weight, model.weight)
    marker = tmp_path / "marker"
    (tmp_path / SHARDED_STATE_DIR / METADATA_FILE).write_bytes(pickle.dumps(MarkerPayload(marker)))
    with pytest.raises(CheckpointFormatError, match="refers to io.open"):
        load_sharded_state(restored, torch.optim.AdamW(restored.parameters()), tmp_path)
    assert not marker.exists()


def test_metadata_claiming_more_than_the_files_hold_is_refused_before_allocating(tmp_path):
    saved = _save(tmp_path / "ck", _state())
    huge = torch.Size([10**7, 10**7])  # 400 TB of float32

    def claim_huge(metadata):
        meta = metadata.state_dict_metadata["model.w"]
        meta.size = huge
        meta.chunks[0].sizes = huge

    _rewrite_metadata(saved, claim_huge)
    with pytest.raises(CheckpointFormatError, match=r"claims 100000000000000 elements of 'model.w' in \d+ bytes"):
        read_dcp_metadata(saved)


@pytest.mark.parametrize("case, match", [
    ("parent path", "no plain file name"),
    ("absolute path", "no plain file name"),
    ("missing file", "does not exist"),
    ("past the end", "places 'model.w' at bytes"),
    ("not an archive", "not torch.save's archive"),
    ("uncovered tensor", "covering 6 of its 12 elements"),
    ("chunk outside", "outside its size"),
    ("transform", "through transforms"),
    ("overlapping", "items overlapping"),
])
def test_metadata_the_files_contradict_is_refused(tmp_path, case, match):
    saved = _save(tmp_path / "ck", _state())
    (tmp_path / "outside.distcp").write_bytes((saved / "__0_0.distcp").read_bytes())

    def change(metadata):
        w = metadata.state_dict_metadata["model.w"]
        info = next(v for k, v in metadata.storage_data.items() if k.fqn == "model.w")
        if case == "parent path":
            info.relative_path = "../outside.distcp"
        elif case == "absolute path":
            info.relative_path = str(tmp_path / "outside.distcp")
        elif case == "missing file":
            info.relative_path = "__9_9.distcp"
        elif case == "past the end":
            info.length = (saved / "__0_0.distcp").stat().st_size
        elif case == "not an archive":
            info.length -= 30  # the archive's end record cut off
        elif case == "uncovered tensor":
            w.chunks[0].sizes = torch.Size([3, 2])
        elif case == "chunk outside":
            w.chunks[0].offsets = torch.Size([1, 0])
        elif case == "transform":
            info.transform_descriptors = ["zstd"]
        elif case == "overlapping":  # every item the same bytes: parsed and read once per item
            for other in metadata.storage_data.values():
                other.offset, other.length = info.offset, info.length

    _rewrite_metadata(saved, change)
    with pytest.raises(CheckpointFormatError, match=match) as err:
        load_dcp({"model": {"w": torch.zeros(3, 4), "b": torch.zeros(4)}}, saved, alone=True)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("data", [b"", b"not a pickle", pickle.dumps([1, 2, 3]), pickle.dumps({"a": 1}),
                                  b"\x80\x04K\x01" * 10, pickle.dumps(torch.Size([2, 3]))])
def test_garbage_metadata_is_one_line_error(tmp_path, data):
    saved = _save(tmp_path / "ck", _state())
    (saved / METADATA_FILE).write_bytes(data)
    with pytest.raises(CheckpointFormatError) as err:
        read_dcp_metadata(saved)
    assert str(err.value).startswith(str(saved / METADATA_FILE)) and "\n" not in str(err.value)


class _EnumByNamePickler(pickle.Pickler):
    """Pickles an enum member as `getattr(enum, name)`, as Debian's Python 3.11.2 does (3.11.7's pickles its value)."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def _pickle_enums_by_name(obj) -> bytes:
    out = io.BytesIO()
    _EnumByNamePickler(out, protocol=4).dump(obj)
    return out.getvalue()


def test_metadata_whose_enum_members_are_pickled_by_name_loads(tmp_path):
    saved = _save(tmp_path / "ck", _state())
    trusted = pickle.loads((saved / METADATA_FILE).read_bytes())
    data = _pickle_enums_by_name(trusted)
    assert b"getattr" in data and b"TORCH_CONTIGUOUS_FORMAT" in data
    (saved / METADATA_FILE).write_bytes(data)
    assert read_dcp_metadata(saved) == trusted
    state = {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(4)}, "optim": {"lr": 0.0, "betas": (0.0, 0.0),
                                                                             "step": 0}}
    load_dcp(state, saved, alone=True)
    assert torch.equal(state["model"]["w"], _state()["model"]["w"]) and state["optim"]["step"] == 3


class _Lookup:
    """Unpickles as getattr(owner, name)."""

    def __init__(self, owner, name):
        self.owner, self.name = owner, name

    def __reduce__(self):
        return getattr, (self.owner, self.name)


@pytest.mark.parametrize("owner, name", [(_MEM_FORMAT_ENCODING, "__class__"), (_MEM_FORMAT_ENCODING, "_member_map_"),
                                         (_MEM_FORMAT_ENCODING, 0), (PurePosixPath, "joinpath"),
                                         (torch.Size, "count")])
def test_a_lookup_other_than_a_member_of_dcps_enums_is_refused(tmp_path, owner, name):
    saved = _save(tmp_path / "ck", _state())
    (saved / METADATA_FILE).write_bytes(pickle.dumps([_Lookup(owner, name)]))
    with pytest.raises(CheckpointFormatError, match="other than a member of DCP's enums"):
        read_dcp_metadata(saved)
