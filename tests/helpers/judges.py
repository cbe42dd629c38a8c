"""Test helper: two scripted simulator servers configured to differ, for cross-judge tests.

`base` serves the default scenario; `deaf` serves a copy in which one doubt category's `resolve` cues are a phrase
no agent says, so a user with that behaviour never has the doubt settled, no SOP step counts after it is voiced,
and the call cannot complete (the scripted persona's rules, docs/scenario_schema.md section 5). Everything else
(persona text, lines, seeds) is the same, so a dialogue whose user lacks the behaviour runs identically under both.
"""
from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

from llm_agent.scenario import load_scenario

from tests.helpers.repo import SCENARIO_PATH
from tests.helpers.sim_servers import SimServers

DEAF_CATEGORY = "cost_concerns"
NEVER_SAID = "zzqx-never-said"


def deaf_scenario(out_dir: Path, category: str = DEAF_CATEGORY) -> Path:
    """The default scenario with `category`'s resolve cues replaced by `NEVER_SAID`, written into `out_dir`
    (its behaviour library path made absolute); checked by loading it back."""
    text = SCENARIO_PATH.read_text()
    library = re.search(r"^behavior_library: (.+)$", text, flags=re.M).group(1).strip()
    text = text.replace(f"behavior_library: {library}",
                        f"behavior_library: {(SCENARIO_PATH.parent / library).resolve()}")
    lines, current, replaced = [], None, 0
    for line in text.splitlines(keepends=True):
        if match := re.match(r"^    (\w+):\s*$", line):
            current = match.group(1)
        if current == category and line.startswith("      resolve:"):
            line, replaced = f"      resolve: [{json.dumps(NEVER_SAID)}]\n", replaced + 1
        lines.append(line)
    assert replaced == 1, f"{category}'s resolve line not found in {SCENARIO_PATH}"
    path = out_dir / f"deaf_{category}.yaml"
    path.write_text("".join(lines))
    assert load_scenario(path).scripted.categories[category].resolve.sources == (NEVER_SAID,)
    return path


@contextlib.contextmanager
def base_and_deaf_servers(tmp_path: Path) -> Iterator[dict[str, str]]:
    """{"base": url, "deaf": url}: one scripted server of each kind on loopback, stopped by PID afterwards."""
    servers = SimServers(tmp_path / "sims")
    try:
        urls = {"base": servers.start(), "deaf": servers.start("--scenario", str(deaf_scenario(tmp_path)))}
        servers.wait_ready(*urls.values())
        yield urls
    finally:
        servers.stop_all()


def completion_rate(lines: list[dict]) -> float:
    """Completed dialogues over non-error ones, counted from log lines (the definition of docs, recounted)."""
    scored = [line for line in lines if line["outcome"] != "error"]
    return sum(line["outcome"] == "completed" for line in scored) / len(scored)


def has_category(line: dict, category: str = DEAF_CATEGORY) -> bool:
    """True when the dialogue's user profile has a behaviour of `category`."""
    return any(b["category"] == category for b in line["profile"]["behaviors"])
