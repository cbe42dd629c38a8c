"""The trace beside the plan: per phase, each line item's bytes from the planner and from the trace with the
dtypes the trace found in it, the collectives FSDP2 issued against those the memory model predicts, the weight
sync's buckets, and the line items that differ.

A memory line item differs when the two disagree by more than :data:`TOLERANCE` of the larger and by more than
:data:`NOISE_SHARE` of the phase's peak (an item of a few MB beside a peak of tens of GB is noise). A collective
line differs when the counts differ or the bytes by more than :data:`TOLERANCE` (shards padded to equal rows add
a little), or when the trace issued a collective the model does not predict (another dtype, say).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from verl.trainer.plan_setup import Phase, Setup
from verl.utils.memory_model import FP32
from verl.utils.memory_model_fsdp import FsdpUnits, parameter_rows, pass_collectives, sync_buckets
from verl.utils.memory_trace import ACTIVATIONS, CATEGORIES, GATHERED, LOGITS, MemoryTrace, PhaseMemory, dtype_name

GB = 1e9
TOLERANCE = 0.10
NOISE_SHARE = 0.01
PEAK = "peak"
_MODEL_OF = {"old log-probs": "actor", "reference log-probs": "ref", "values": "critic", "update critic": "critic",
             "update actor": "actor"}


@dataclass(frozen=True)
class LineItem:
    """One memory line of a phase: the planner's and the trace's bytes."""

    phase: str
    item: str
    planned: float
    traced: float

    def differs(self, phase_peak: float) -> bool:
        """Whether the two disagree beyond the tolerance (and the noise floor of ``phase_peak``)."""
        gap = abs(self.planned - self.traced)
        return gap > TOLERANCE * max(self.planned, self.traced) and gap > NOISE_SHARE * phase_peak

    def line(self) -> str:
        """``phase: item planned X GB, traced Y GB (+Z%)``."""
        change = f"{(self.traced - self.planned) / self.planned * 100:+.0f}%" if self.planned >= GB / 1000 else "new"
        return (f"{self.phase}: {self.item} planned {self.planned / GB:.2f} GB, traced {self.traced / GB:.2f} GB "
                f"({change})")


@dataclass(frozen=True)
class CollectiveLine:
    """One kind of collective in one dtype during a phase: (count, bytes) predicted and traced."""

    phase: str
    kind: str
    dtype: str
    planned: tuple[int, int]
    traced: tuple[int, int]

    def differs(self) -> bool:
        """Another count, or bytes beyond the tolerance."""
        (pc, pb), (tc, tb) = self.planned, self.traced
        return pc != tc or abs(pb - tb) > TOLERANCE * max(pb, tb)

    def line(self) -> str:
        """``phase: kind dtype planned N (X GB), traced M (Y GB)``."""
        return (f"{self.phase}: {self.kind} {self.dtype} planned {self.planned[0]} ({self.planned[1] / GB:.2f} GB), "
                f"traced {self.traced[0]} ({self.traced[1] / GB:.2f} GB)")


@dataclass
class TraceReport:
    """The side-by-side tables and what differs."""

    header: str
    items: list[LineItem]
    collectives: list[CollectiveLine]
    phases: list[PhaseMemory]
    differences: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def format(self) -> str:
        """The printed report."""
        lines = [self.header, f"{'phase (per GPU, GB)':<22}{'item':<16}{'plan':>9}{'trace':>9}  trace dtypes"]
        by_phase = {p.name: p for p in self.phases}
        for item in self.items:
            dtypes = ", ".join(f"{d} {v / GB:.2f}" for d, v in sorted(by_phase[item.phase].dtypes[item.item].items())
                               if v >= GB / 100) if item.item in CATEGORIES else ""
            flag = "  <- differs" if item.line() in self.differences else ""
            lines.append(f"{item.phase:<22}{item.item:<16}{item.planned / GB:>9.2f}{item.traced / GB:>9.2f}  "
                         f"{dtypes}{flag}")
        lines.append(f"{'phase (collectives)':<22}{'kind':<26}{'plan':>16}{'trace':>16}")
        for c in self.collectives:
            flag = "  <- differs" if c.line() in self.differences else ""
            lines.append(f"{c.phase:<22}{c.kind + ' ' + c.dtype:<26}{c.planned[0]:>6} x {c.planned[1] / GB:>6.2f} GB"
                         f"{c.traced[0]:>6} x {c.traced[1] / GB:>6.2f} GB{flag}")
        lines += [f"  {note}" for note in self.notes]
        lines += [f"  traced in {p.seconds:.0f} s: {p.name}" for p in self.phases]
        if not self.differences:
            lines.append(f"trace and plan agree within {TOLERANCE:.0%} on every line item")
        else:
            lines.append(f"{len(self.differences)} line item(s) differ:")
            lines += [f"  - {d}" for d in self.differences]
        return "\n".join(lines)


def _traced_collectives(phase: PhaseMemory) -> dict[tuple[str, str], tuple[int, int]]:
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for collective in phase.collectives:
        groups[(collective.kind, collective.dtype)].append(collective.nbytes)
    return {key: (len(sizes), sum(sizes)) for key, sizes in groups.items()}


def _planned_collectives(s: Setup, phase: str) -> dict[tuple[str, str], tuple[int, int]]:
    """What the memory model predicts a traced phase issues."""
    rollout = s.cfg.actor_rollout_ref.rollout
    if phase == "weight sync":
        lora = s.actor_lora if s.syncs_adapter else None
        rows = parameter_rows(s.actor, lora.settings.rank, lora.modules) if lora else parameter_rows(s.actor)
        buckets = sync_buckets(rows, s.world, s.compute_bytes, int(rollout.update_weights_bucket_megabytes * 2**20))
        total = sum(map(sum, buckets)) * s.compute_bytes
        return {("all_gather", dtype_name_of(s.compute_bytes)): (len(buckets), total)}
    model = _MODEL_OF[phase]
    critic = model == "critic"
    shape, lora = (s.critic, s.critic_lora) if critic else (s.actor, s.actor_lora)
    compute = s.compute_bytes if not critic else (4 if s.cfg.critic.fsdp_config.param_dtype in ("fp32", "float32")
                                                  else 2)
    units = FsdpUnits.of(shape, value_head=critic, adapter_params=lora.params if lora else 0)
    training = phase.startswith("update")
    if lora is None:
        trainable, trainable_units = units.params, units.count
    else:
        trainable = lora.params + (shape.hidden_size + 1 if critic else 0)
        trainable_units = units.layers + (1 if critic else 0)
    predicted = pass_collectives(units, compute, training, trainable, trainable_units)
    planned = {("all_gather", dtype_name_of(compute)): predicted.all_gathers}
    if training:
        planned[("reduce_scatter", dtype_name_of(FP32))] = predicted.reduce_scatters
    return planned


_TRANSIENT = (GATHERED, ACTIVATIONS, LOGITS)


def _planned_at_traced_moment(plan_phase: Phase, traced: PhaseMemory) -> tuple[dict[str, float], str]:
    """The planner's items of a phase at the moment of the pass the trace peaked at: of the planner's candidate
    moments, the one whose transient items (gathered units, activations, logits) are nearest the trace's, each
    item's gap relative to the larger of the two (its resident items are the phase's); the peak line is the
    planner's largest moment. Also a note when that moment is not the planner's largest."""
    resident = {c: float(plan_phase.memory.get(c, 0.0)) for c in CATEGORIES}
    planned = {**resident, PEAK: sum(resident.values())}
    if not plan_phase.moments:
        return planned, ""
    largest = max(plan_phase.moments, key=lambda m: m.total)

    def split(moment) -> dict[str, float]:
        return {GATHERED: float(moment.gathered), ACTIVATIONS: float(moment.activations), LOGITS: float(moment.logits)}

    floor = NOISE_SHARE * traced.total

    def distance(moment) -> float:
        return sum(abs(v - traced.peak[c]) / max(v, traced.peak[c], floor) for c, v in split(moment).items())

    nearest = min(plan_phase.moments, key=distance)
    planned.update(split(nearest))
    if nearest is largest:
        return planned, ""
    below = (largest.total - nearest.total) / (planned[PEAK] or 1)
    return planned, (f"{traced.name}: items compared at the planner's moment '{nearest.moment}', where the trace "
                     f"peaked; the planner's largest is '{largest.moment}', {below:.1%} of the phase above it")


def dtype_name_of(nbytes: int) -> str:
    """The compute dtype's name from its size (2: bf16, 4: fp32)."""
    return "bf16" if nbytes == 2 else "fp32"


def compare(s: Setup, trace: MemoryTrace, received: list[tuple[str, int]],
            plan_phases: dict[str, Phase], weight_dtype: Any) -> TraceReport:
    """The report of a traced step against the planner's phases of the same setup."""
    items: list[LineItem] = []
    collectives: list[CollectiveLine] = []
    differences: list[str] = []
    report_notes: list[str] = []
    for phase in trace.phases:
        key = phase.name.split(" (")[0]
        if key in plan_phases:
            planned, moment = _planned_at_traced_moment(plan_phases[key], phase)
            if moment:
                report_notes.append(moment)
            traced = {**{c: float(phase.peak[c]) for c in CATEGORIES}, PEAK: float(phase.total)}
            for name in (*CATEGORIES, PEAK):
                item = LineItem(phase.name, name, planned[name], traced[name])
                items.append(item)
                if item.differs(max(planned[PEAK], traced[PEAK])):
                    differences.append(item.line())
        expected, seen = _planned_collectives(s, key), _traced_collectives(phase)
        for kind, dtype in sorted(set(expected) | set(seen)):
            line = CollectiveLine(phase.name, kind, dtype, expected.get((kind, dtype), (0, 0)),
                                  seen.get((kind, dtype), (0, 0)))
            collectives.append(line)
            if line.differs():
                differences.append(line.line())
    header = (f"trace: {s.actor.num_params() / 1e9:.2f}B parameters, rank 1 of {s.world} (fake tensors, fake "
              f"process group), compute dtype {dtype_name_of(s.compute_bytes)}; the planner's items without the vLLM "
              f"engine, KV cache and CUDA contexts")
    report = TraceReport(header, items, collectives, list(trace.phases), differences, report_notes)
    if received:
        sync = next(p for p in trace.phases if p.name == "weight sync")
        sizes = sorted(c.nbytes for c in sync.collectives if c.kind == "all_gather")
        limit = s.cfg.actor_rollout_ref.rollout.update_weights_bucket_megabytes
        report.notes.append(
            f"weight sync: {len(received)} tensors, {sum(n for _, n in received) / GB:.2f} GB in "
            f"{dtype_name(weight_dtype)}, in {len(sizes)} buckets of {sizes[0] / 2**20:.0f}-"
            f"{sizes[-1] / 2**20:.0f} MiB "
            f"(update_weights_bucket_megabytes {limit:g}; a larger tensor is a bucket of its own)")
    return report
