"""The trace beside the plan: per phase, each line item's bytes from the planner and from the trace, the line
items that differ, the dtypes of each group, the collectives issued and the weight sync's buckets.

A line item differs when the two disagree by more than :data:`TOLERANCE` of the larger and by more than
:data:`NOISE_SHARE` of the phase's peak (an item of a few MB beside a peak of tens of GB is noise).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from verl.trainer import plan as planner
from verl.utils.memory_trace import CATEGORIES, MemoryTrace, PhaseMemory

GB = 1e9
TOLERANCE = 0.10
NOISE_SHARE = 0.01
PEAK = "peak"


@dataclass(frozen=True)
class LineItem:
    """One line of a phase: the planner's and the trace's bytes."""

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
        change = (self.traced - self.planned) / self.planned * 100 if self.planned else float("inf")
        return (f"{self.phase}: {self.item} planned {self.planned / GB:.2f} GB, traced {self.traced / GB:.2f} GB "
                f"({change:+.0f}%)")


@dataclass
class TraceReport:
    """The side-by-side table and what differs."""

    header: str
    items: list[LineItem]
    phases: list[PhaseMemory]
    differences: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def format(self) -> str:
        """The printed report."""
        lines = [self.header, f"{'phase (per GPU, GB)':<22}{'item':<16}{'plan':>9}{'trace':>9}  trace dtypes"]
        by_phase = {p.name: p for p in self.phases}
        for item in self.items:
            phase = by_phase[item.phase]
            dtypes = ", ".join(f"{d} {v / GB:.2f}" for d, v in sorted(phase.dtypes.get(item.item, {}).items()))
            flag = "  <- differs" if item.line() in self.differences else ""
            lines.append(f"{item.phase:<22}{item.item:<16}{item.planned / GB:>9.2f}{item.traced / GB:>9.2f}  "
                         f"{dtypes}{flag}")
        for phase in self.phases:
            lines.append(f"{phase.name}: collectives {format_collectives(phase)}")
        lines += [f"  {note}" for note in self.notes]
        verdict = (f"trace and plan agree within {TOLERANCE:.0%} per line item" if not self.differences else
                   f"{len(self.differences)} line item(s) differ by more than {TOLERANCE:.0%}:")
        lines.append(verdict)
        lines += [f"  - {d}" for d in self.differences]
        return "\n".join(lines)


def format_collectives(phase: PhaseMemory) -> str:
    """``all_gather bf16: 62 (7.61 GB, largest 1.09 GB); ...`` or ``none``."""
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for collective in phase.collectives:
        groups[(collective.kind, collective.dtype)].append(collective.nbytes)
    if not groups:
        return "none"
    return "; ".join(f"{kind} {dtype}: {len(sizes)} ({sum(sizes) / GB:.2f} GB, largest {max(sizes) / GB:.2f} GB)"
                     for (kind, dtype), sizes in sorted(groups.items()))


def _planned(phase: planner.Phase) -> dict[str, float]:
    items = {c: float(phase.memory.get(c, 0.0)) for c in CATEGORIES}
    items[PEAK] = sum(items.values())
    return items


def compare(setup: planner.Setup, trace: MemoryTrace, settings, plan_phases: dict[str, planner.Phase]
            ) -> TraceReport:
    """The report of a traced step against the planner's phases of the same setup."""
    items: list[LineItem] = []
    differences: list[str] = []
    for phase in trace.phases:
        key = phase.name.split(" (")[0]
        if key not in plan_phases:
            continue
        planned = _planned(plan_phases[key])
        traced = {**{c: float(phase.peak[c]) for c in CATEGORIES}, PEAK: float(phase.total)}
        peak = max(planned[PEAK], traced[PEAK])
        for name in (*CATEGORIES, PEAK):
            item = LineItem(phase.name, name, planned[name], traced[name])
            items.append(item)
            if item.differs(peak):
                differences.append(item.line())
    header = (f"trace: {setup.actor.num_params() / 1e9:.2f}B parameters on rank 1 of {setup.world} (fake tensors, "
              f"fake process group); compute dtype {'bf16' if setup.compute_bytes == 2 else 'fp32'}; planner "
              f"items without the vLLM engine, KV cache and CUDA contexts")
    report = TraceReport(header, items, list(trace.phases), differences)
    if settings.received:
        sent = sum(nbytes for _, nbytes in settings.received)
        report.notes.append(f"weight sync: {len(settings.received)} tensors, {sent / GB:.2f} GB sent in "
                            f"{settings.weight_dtype}")
    return report
