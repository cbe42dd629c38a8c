"""Device memory of a computation counted from its tensors' storages: live bytes by category, each phase's peak and
the dtypes at it, and the collectives issued with their sizes.

:class:`MemoryTrace` is a ``TorchDispatchMode``: it sees every operator's outputs, so it knows when a storage is
allocated (an output whose storage it has not seen, or a storage grown by ``UntypedStorage.resize_``, which is how
FSDP2 allocates and frees its unsharded parameters) and a weak reference tells it when the storage is freed. It
counts fake tensors (``FakeTensorMode``) exactly like real ones, so a full-size model step is measured without the
memory, as torchtitan's memory estimator does (this module shares no code with it). The caching allocator's
rounding and fragmentation are not modelled: the counts are the bytes tensors hold.

Categories (the planner's, :mod:`verl.trainer.plan`): what :meth:`MemoryTrace.track` registers (``weights``,
``optimizer``), ``gradients`` (storages given that category by :meth:`MemoryTrace.categorize`, e.g. the parameters'
``.grad`` after a backward pass, for the whole phase), ``gathered units`` (FSDP's gathered parameters and
communication buffers: outputs of the ``fsdp`` operators and storages grown by ``resize_``), ``logits`` (outputs whose
last dimension is the vocabulary) and everything else, ``activations`` (or a phase's own default category).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

WEIGHTS, OPTIMIZER, GRADIENTS, GATHERED, ACTIVATIONS, LOGITS = (
    "weights", "optimizer", "gradients", "gathered units", "activations", "logits")
CATEGORIES = (WEIGHTS, OPTIMIZER, GRADIENTS, GATHERED, ACTIVATIONS, LOGITS)
UNKNOWN_DTYPE = "?"
# c10d operators by the collective they run (the functional collectives' names end the same way)
_COLLECTIVES = {"allgather": "all_gather", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
                "allreduce": "all_reduce", "all_reduce": "all_reduce", "broadcast": "broadcast",
                "alltoall": "all_to_all", "all_to_all": "all_to_all"}


def tensor_storages(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages holding ``tensor``'s data: its own, or a wrapper subclass's (e.g. a DTensor's local shard)."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        inner = [getattr(tensor, name) for name in names]
        return [st for t in inner if isinstance(t, torch.Tensor) for st in tensor_storages(t)]
    return [tensor.untyped_storage()]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``bf16``, ``torch.float32`` -> ``fp32``; other dtypes by their torch name."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(
        dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class Collective:
    """One collective: its kind (all_gather, reduce_scatter, ...), the bytes of its full buffer (a gather's output,
    a reduce-scatter's input) and their dtype."""

    kind: str
    nbytes: int
    dtype: str


@dataclass
class PhaseMemory:
    """One phase: the bytes of each category at the phase's peak, the dtypes within each, the collectives."""

    name: str
    peak: dict[str, int]
    dtypes: dict[str, dict[str, int]]
    collectives: list[Collective] = field(default_factory=list)
    seconds: float = 0.0  # wall time of tracing the phase

    @property
    def total(self) -> int:
        """The peak: live bytes of every category at its moment."""
        return sum(self.peak.values())

    def collective_counts(self) -> Counter:
        """How many collectives of each (kind, bytes, dtype) the phase issued."""
        return Counter(self.collectives)


@dataclass
class _Record:
    nbytes: int
    category: str
    dtype: str
    on_device: bool = True


class MemoryTrace(TorchDispatchMode):
    """Live storages by category while active (``with trace:``); phases (:meth:`phase`) record their peaks.

    ``logits_width``: outputs whose last dimension has this size count as ``logits`` (the vocabulary).
    """

    def __init__(self, logits_width: int | None = None):
        super().__init__()
        self.logits_width = logits_width
        self.phases: list[PhaseMemory] = []
        self._records: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._refs: dict[int, weakref.ref] = {}
        self._events: list[tuple[_Record, int]] | None = None
        self._collectives: list[Collective] = []
        self._default = ACTIVATIONS
        self._resize = None

    # --- registering storages --------------------------------------------------------------------------------
    def track(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        """Count ``tensors``' storages (allocated before the trace: parameters, optimizer state) as ``category``."""
        for tensor in tensors:
            for storage in tensor_storages(tensor):
                record = self._records.get(storage) or self._add(storage, tensor.dtype, category)
                record.category = category

    def categorize(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        """Count ``tensors``' live storages as ``category`` from their allocation on (e.g. gradients)."""
        self.track(tensors, category)

    def set_on_device(self, tensors: Iterable[torch.Tensor], on_device: bool) -> None:
        """Count ``tensors``' storages (``on_device``) or leave them out as offloaded to host memory; between phases."""
        if self._events is not None:
            raise RuntimeError("set_on_device between phases only")
        for tensor in tensors:
            for storage in tensor_storages(tensor):
                record = self._records.get(storage)
                if record is not None:
                    record.on_device = on_device

    def live_bytes(self, category: str | None = None) -> int:
        """Bytes of the live, on-device storages (of ``category``, or all)."""
        return sum(r.nbytes for r in self._records.values()
                   if r.on_device and (category is None or r.category == category))

    def _add(self, storage: torch.UntypedStorage, dtype: torch.dtype | None, category: str) -> _Record:
        record = _Record(storage.nbytes(), category, dtype_name(dtype) if dtype is not None else UNKNOWN_DTYPE)
        self._records[storage] = record
        ref = weakref.ref(storage, lambda ref, rec=record: self._freed(rec, ref))
        self._refs[id(ref)] = ref
        self._event(record, record.nbytes)
        return record

    def _freed(self, record: _Record, ref: weakref.ref) -> None:
        self._refs.pop(id(ref), None)
        self._event(record, -record.nbytes)
        record.nbytes = 0

    def _event(self, record: _Record, delta: int) -> None:
        if self._events is not None and delta:
            self._events.append((record, delta))

    def _resized(self, storage: torch.UntypedStorage) -> None:
        record = self._records.get(storage)
        if record is None:  # an FSDP2 unsharded parameter allocated before the trace; its dtype comes from copy-out
            self._add(storage, None, GATHERED)
            return
        delta = storage.nbytes() - record.nbytes
        record.nbytes = storage.nbytes()
        self._event(record, delta)

    # --- the dispatch mode -----------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        namespace = name.split(".", 1)[0]
        if namespace in ("c10d", "_c10d_functional"):
            self._collective(name, args, kwargs)
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                for storage in tensor_storages(tensor):
                    if storage not in self._records:
                        self._add(storage, tensor.dtype, self._category_of(tensor))
        if namespace == "fsdp":
            self._fsdp_buffers(tree_flatten((args, kwargs, out))[0])
        return out

    def _fsdp_buffers(self, tensors: list) -> None:
        """Storages an FSDP operator reads or writes besides parameters, gradients and optimizer state (the
        all-gather buffers, the unsharded parameters it copies out to, the unsharded gradients and the reduce-scatter
        buffer) count as gathered units from their allocation; copy-out names the unsharded parameters' dtype."""
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                for storage in tensor_storages(tensor):
                    record = self._records.get(storage)
                    if record is None:
                        continue
                    if record.category in (ACTIVATIONS, LOGITS):
                        record.category = GATHERED
                    if record.dtype == UNKNOWN_DTYPE:
                        record.dtype = dtype_name(tensor.dtype)

    def _category_of(self, tensor: torch.Tensor) -> str:
        if self.logits_width and tensor.dim() and tensor.shape[-1] == self.logits_width:
            return LOGITS
        return self._default

    def _collective(self, name: str, args, kwargs) -> None:
        op = name.split(".")[1].strip("_").removesuffix("_base").removesuffix("_into_tensor")
        kind = next((k for prefix, k in _COLLECTIVES.items() if op.startswith(prefix)), op)
        if kind not in _COLLECTIVES.values():
            return  # waits, barriers, point-to-point
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if tensors:
            largest = max(tensors, key=lambda t: t.numel() * t.element_size())
            self._collectives.append(Collective(kind, largest.numel() * largest.element_size(),
                                                dtype_name(largest.dtype)))

    def __enter__(self):
        original = torch.UntypedStorage.resize_
        trace = self

        def resize_(storage, size):  # FSDP2 allocates and frees its unsharded parameters this way
            result = original(storage, size)
            trace._resized(storage)
            return result

        self._resize = original
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    # --- phases ----------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str, default: str = ACTIVATIONS) -> Iterator[None]:
        """Record the peak of the block as phase ``name``; new storages of no other category count as ``default``."""
        if self._events is not None:
            raise RuntimeError(f"phase {name!r} started inside another phase")
        baseline = [(r, r.nbytes) for r in self._records.values() if r.nbytes]
        self._events, self._collectives, self._default = [], [], default
        start = time.perf_counter()
        try:
            yield
        finally:
            events, self._events, self._default = self._events, None, ACTIVATIONS
            self.phases.append(_replay(name, baseline, events, self._collectives))
            self.phases[-1].seconds = time.perf_counter() - start

    def __getitem__(self, name: str) -> PhaseMemory:
        """The recorded phase ``name``."""
        for phase in self.phases:
            if phase.name == name:
                return phase
        raise KeyError(f"no traced phase {name!r} (traced: {[p.name for p in self.phases]})")


def _replay(name: str, baseline: list[tuple[_Record, int]], events: list[tuple[_Record, int]],
            collectives: list[Collective]) -> PhaseMemory:
    """The phase's peak from its start and its allocation events; categories as they are at the phase's end (a
    gradient counts as one from its allocation), offloaded storages left out."""
    live: Counter = Counter()
    for record, nbytes in baseline:
        if record.on_device:
            live[(record.category, record.dtype)] += nbytes
    total = best = sum(live.values())
    at_peak = Counter(live)
    for record, delta in events:
        if not record.on_device:
            continue
        live[(record.category, record.dtype)] += delta
        total += delta
        if total > best:
            best, at_peak = total, Counter(live)
    peak = {c: sum(v for (cat, _), v in at_peak.items() if cat == c) for c in CATEGORIES}
    dtypes = {c: {d: v for (cat, d), v in at_peak.items() if cat == c and v} for c in CATEGORIES}
    return PhaseMemory(name, peak, dtypes, list(collectives))
