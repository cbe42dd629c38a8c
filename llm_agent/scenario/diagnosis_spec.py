"""The scenario's failure-diagnosis rules (`diagnosis:` in the YAML): which label each failure pattern gets.

A scenario names its labels and gives each one rule kind with that kind's parameters (docs/scenario_schema.md
section 8); `llm_agent.diagnosis` applies them to dialogue records. This module only validates and holds them:
`read_diagnosis` is called by the scenario loader with its reader (placeholders filled, errors naming the file and
key path) once the `scripted` section is parsed, because cue lists may include the scripted cue lists by
reference (`@cues.pushy`, `@steps`, `@categories.cost_concerns.resolve`, ...).
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llm_agent.scenario.tags import CueList
from llm_agent.scenario.types import ScriptedSpec, StateSchema

__all__ = ["DiagnosisRule", "DoubtCues", "RULE_KINDS", "read_diagnosis"]

# rule kind -> (required parameters, optional parameters)
RULE_KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "unanswered_doubt": ((), ("doubts",)),
    "false_claim": ((), ("claims",)),
    "premature_push": (("push", "ready"), ()),
    "drop_before_hang_up": ((), ("dimensions", "drop", "window")),
    "format_error": ((), ()),
    "loop_to_timeout": ((), ()),
    "truncated": ((), ()),
}
_LABEL = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True)
class DoubtCues:
    """One doubt category: cues that show the user raised it (on the user's reply) and cues that answer it (on
    the agent's next reply)."""

    category: str
    raised: CueList
    answered: CueList


@dataclass(frozen=True)
class DiagnosisRule:
    """One label and the rule that puts it on agent turns of a dialogue that did not complete.

    Only the parameters of the rule's kind are set: `doubts` (unanswered_doubt), `cues` (the claims of
    false_claim, the pushes of premature_push), `ready` (premature_push: {dimension: the value the user must be at
    least as well off as}), `dimensions`, `drop` and `window` (drop_before_hang_up; empty `dimensions`: every
    dimension).
    """

    label: str
    kind: str
    doubts: tuple[DoubtCues, ...] = ()
    cues: CueList | None = None
    ready: dict[str, int] = field(default_factory=dict)
    dimensions: tuple[str, ...] = ()
    drop: int = 1
    window: int = 2


def _ref_sources(ref: str, scripted: ScriptedSpec) -> tuple[str, ...] | None:
    """The cue sources a `@...` reference names in the scripted section, None when it names nothing."""
    parts = ref[1:].split(".")
    head, rest = parts[0], parts[1:]
    if head == "cues" and len(rest) == 1 and rest[0] in scripted.cues:
        return scripted.cues[rest[0]].sources
    if head == "stage_cues" and len(rest) == 1 and rest[0].lstrip("-").isdigit() \
            and int(rest[0]) in scripted.stage_cues:
        return scripted.stage_cues[int(rest[0])].sources
    if head == "steps" and not rest:
        return tuple(src for step in scripted.steps for src in step.guide.sources)
    if head == "steps" and len(rest) == 1:
        found = [step.guide.sources for step in scripted.steps if step.id == rest[0]]
        return found[0] if found else None
    if head == "categories" and len(rest) == 2 and rest[0] in scripted.categories:
        script = scripted.categories[rest[0]]
        if rest[1] == "doubt":
            return script.doubt
        if rest[1] == "resolve":
            return script.resolve.sources
    return None


def _cues(r: Any, node: Any, where: str, scripted: ScriptedSpec) -> CueList:
    """A cue list whose entries may be `@` references to scripted cue lists (their sources are spliced in)."""
    if not isinstance(node, list) or not node:
        r.fail(where, "must be a non-empty list of cues (phrases, re: regexes or @references)")
    sources: list[str] = []
    for i, item in enumerate(node):
        at = f"{where}[{i}]"
        if isinstance(item, str) and item.startswith("@"):
            found = _ref_sources(item.strip(), scripted)
            if found is None:
                r.fail(at, f"unknown reference {item!r} (use @cues.<key>, @stage_cues.<id>, @steps, @steps.<id>, "
                           "@categories.<category>.doubt or @categories.<category>.resolve)")
            sources.extend(found)
            continue
        text = r.text(item, at)
        try:
            CueList.compile([text])
        except re.error as exc:
            r.fail(at, str(exc))
        sources.append(text)
    return CueList.compile(sources)


def _doubts(r: Any, node: Any, where: str, scripted: ScriptedSpec) -> tuple[DoubtCues, ...]:
    if node is None:  # every scripted category: the user's doubt lines raise it, its resolve cues answer it
        return tuple(DoubtCues(c, CueList.compile(s.doubt), s.resolve) for c, s in scripted.categories.items())
    if not isinstance(node, Mapping) or not node:
        r.fail(where, "must be a mapping of category -> {raised, answered}")
    out = []
    for category, spec in node.items():
        at = f"{where}.{category}"
        if not isinstance(category, str) or not _LABEL.fullmatch(category):
            r.fail(at, "category ids must be snake_case")
        spec = r.mapping(spec if spec is not None else {}, at, (), ("raised", "answered"))
        script = scripted.categories.get(category)
        for key in ("raised", "answered"):
            if key not in spec and script is None:
                r.fail(f"{at}.{key}", f"required: {category!r} is not a scripted category to take it from")
        raised = _cues(r, spec["raised"], f"{at}.raised", scripted) if "raised" in spec \
            else CueList.compile(script.doubt)
        answered = _cues(r, spec["answered"], f"{at}.answered", scripted) if "answered" in spec else script.resolve
        out.append(DoubtCues(category, raised, answered))
    return tuple(out)


def _rule(r: Any, label: str, node: Any, where: str, scripted: ScriptedSpec, schema: StateSchema) -> DiagnosisRule:
    if not isinstance(node, Mapping) or "rule" not in node:
        r.fail(where, f"must be a mapping with a 'rule' (one of {', '.join(RULE_KINDS)})")
    kind = node["rule"]
    if kind not in RULE_KINDS:
        r.fail(f"{where}.rule", f"unknown rule {kind!r} (one of {', '.join(RULE_KINDS)})")
    required, optional = RULE_KINDS[kind]
    node = r.mapping(node, where, ("rule", *required), optional)
    params: dict[str, Any] = {}
    if kind == "unanswered_doubt":
        params["doubts"] = _doubts(r, node.get("doubts"), f"{where}.doubts", scripted)
        if not params["doubts"]:
            r.fail(f"{where}.doubts", "no doubt category to check (the scripted section has none)")
    elif kind == "false_claim" and "claims" in node:
        params["cues"] = _cues(r, node["claims"], f"{where}.claims", scripted)
    elif kind == "premature_push":
        params["cues"] = _cues(r, node["push"], f"{where}.push", scripted)
        ready = r.mapping(node["ready"], f"{where}.ready", (), schema.names)
        if not ready:
            r.fail(f"{where}.ready", f"name at least one of {list(schema.names)} with the value the user must be "
                                     "at least as well off as")
        for dim, value in ready.items():
            value = r.integer(value, f"{where}.ready.{dim}")
            if not schema[dim].range.contains(value):
                r.fail(f"{where}.ready.{dim}", f"{value} is outside the {dim} range")
            params.setdefault("ready", {})[dim] = value
    elif kind == "drop_before_hang_up":
        dims = node.get("dimensions", list(schema.names))
        if not isinstance(dims, list) or not dims or any(d not in schema.names for d in dims):
            r.fail(f"{where}.dimensions", f"must be a non-empty list of {list(schema.names)}, got {dims!r}")
        params["dimensions"] = tuple(dict.fromkeys(dims))
        for key, default in (("drop", 1), ("window", 2)):
            value = r.integer(node.get(key, default), f"{where}.{key}")
            if value < 1:
                r.fail(f"{where}.{key}", f"must be >= 1, got {value}")
            params[key] = value
    return DiagnosisRule(label=label, kind=kind, **params)


def read_diagnosis(r: Any, node: Any, scripted: ScriptedSpec, schema: StateSchema) -> tuple[DiagnosisRule, ...]:
    """Validate the `diagnosis` section (`{labels: {label: {rule: kind, ...parameters}}}`) and return its rules in
    file order. `r` is the scenario loader's reader: `fail`, `mapping`, `integer` and `text` raise ScenarioError
    naming the file and key path."""
    node = r.mapping(node, "diagnosis", ("labels",))
    labels = node["labels"]
    if not isinstance(labels, Mapping) or not labels:
        r.fail("diagnosis.labels", "must be a non-empty mapping of label -> {rule, ...}")
    rules = []
    for label, spec in labels.items():
        where = f"diagnosis.labels.{label}"
        if not isinstance(label, str) or not _LABEL.fullmatch(label):
            r.fail(where, "labels must be snake_case identifiers")
        rules.append(_rule(r, label, spec, where, scripted, schema))
    return tuple(rules)
