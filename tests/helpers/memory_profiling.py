"""Peak memory of a CPU pass, measured with the torch profiler."""
from __future__ import annotations

import json

from torch.profiler import ProfilerActivity, profile


def measured_peak(fn, trace_path) -> int:
    """The largest number of bytes allocated (since the start) while ``fn`` runs, from the profiler's events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    prof.export_chrome_trace(str(trace_path))
    events = [e for e in json.loads(trace_path.read_text())["traceEvents"] if e.get("name") == "[memory]"]
    return max(e["args"]["Total Allocated"] for e in events)
