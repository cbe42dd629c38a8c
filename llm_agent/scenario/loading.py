"""Loading and validating scenario YAML files and behaviour libraries.

`read_scenario_fields(path)` checks a file against `docs/scenario_schema.md` and returns the keyword arguments of
`llm_agent.scenario.Scenario`; every problem raises ScenarioError naming the file and the key path (YAML syntax
errors: the line). `load_behavior_library` reads the JSONL library and names the file and line of a bad entry.
"""
from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, NoReturn

import yaml

from llm_agent.scenario.diagnosis_spec import read_diagnosis
from llm_agent.scenario.tags import (CueList, TemplateError, bulleted_placeholders, is_identifier,
                                      placeholders, substitute)
from llm_agent.scenario.types import (BETTER, CUE_KEYS, EVENTS, LINE_KEYS, OPTIONAL_LINE_KEYS, STATUS_ROLES, Behavior,
                                      CategoryScript, Dimension, ScenarioError, ScriptedRules, ScriptedSpec,
                                      ScriptedStep, Stage, StateRange, StateSchema, Statuses, TagProtocol)

AGENT_DYNAMIC = ("stages", "facts", "output_format")
USER_FIXED = ("behaviors", "output_format")  # the persona's placeholders besides one per state dimension
AGENT_FIXED_ROLES = ("reply", "stage", "status")
USER_FIXED_ROLES = ("reply", "status")
RESERVED_NAMES = (*AGENT_DYNAMIC, *USER_FIXED, *AGENT_FIXED_ROLES, "think")  # never a state dimension's name
_SNAKE = re.compile(r"[a-z][a-z0-9_]*")
_SHORT = re.compile(r"[a-z]+")


def load_behavior_library(path: str | os.PathLike, categories: Collection[str] | None = None) -> list[Behavior]:
    """Read a JSONL behaviour library: one {"category", "behavior"} object per line (blank lines skipped).

    A malformed line, a missing/empty/extra field, a category that is not snake_case, or (when `categories` is
    given) a category outside it raises ScenarioError naming the file and the 1-based line number.
    """
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ScenarioError(file, "", f"cannot read behaviour library: {exc}") from None
    out = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ScenarioError(file, f"line {lineno}", f"not valid JSON: {exc.msg}") from None
        out.append(_behavior(obj, file, f"line {lineno}", categories))
    if not out:
        raise ScenarioError(file, "", "the behaviour library is empty")
    return out


def _behavior(obj: Any, file: str, where: str, categories: Collection[str] | None) -> Behavior:
    try:
        b = Behavior.from_dict(obj)
    except ValueError as exc:
        raise ScenarioError(file, where, str(exc)) from None
    if not _SNAKE.fullmatch(b.category):
        raise ScenarioError(file, where, f"category {b.category!r} is not a snake_case id")
    if categories is not None and b.category not in categories:
        raise ScenarioError(file, where, f"category {b.category!r} has no entry in scripted.categories "
                                         f"(known: {sorted(categories)})")
    return b


class _Reader:
    """Walks the parsed YAML, filling static placeholders and raising ScenarioError with key paths."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.vars: dict[str, str] = {}

    def fail(self, where: str, reason: str) -> NoReturn:
        raise ScenarioError(self.file, where, reason)

    def mapping(self, node: Any, where: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
        if not isinstance(node, Mapping):
            self.fail(where or "(top level)", f"must be a mapping, got {type(node).__name__}")
        allowed = (*required, *optional)
        unknown = [str(k) for k in node if k not in allowed]
        for key in required:
            if key not in node:
                close = difflib.get_close_matches(key, unknown, n=1)
                hint = f" ({close[0]!r} in the file: did you mean {key!r}?)" if close else ""
                self.fail(_join(where, str(key)), f"missing required key{hint}")
        if unknown:
            close = difflib.get_close_matches(unknown[0], allowed, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            self.fail(_join(where, unknown[0]), f"unknown key ({hint}allowed: {', '.join(allowed)})")
        return dict(node)

    def integer(self, node: Any, where: str) -> int:
        if isinstance(node, bool) or not isinstance(node, int):
            self.fail(where, f"must be an integer, got {node!r}")
        return node

    def raw_str(self, node: Any, where: str) -> str:
        if not isinstance(node, str) or not node.strip():
            self.fail(where, f"must be a non-empty string, got {node!r}")
        return node

    def text(self, node: Any, where: str) -> str:
        """A non-empty string with every placeholder a `vars` key (filled; `$$` becomes `$`)."""
        self.template(node, where, allowed=(), required=())
        return substitute(node, self.vars)

    def template(self, node: Any, where: str, allowed: tuple[str, ...], required: tuple[str, ...]) -> str:
        """A template: static placeholders filled; `allowed` dynamic ones kept for render time."""
        raw = self.raw_str(node, where)
        try:
            names = placeholders(raw)
        except TemplateError as exc:
            self.fail(where, str(exc))
        for name in names:
            if name not in self.vars and name not in allowed:
                self.fail(where, f"unknown placeholder ${{{name}}} (vars: {sorted(self.vars)}; "
                                 f"allowed here: {list(allowed)})")
        for name in required:
            if name not in names:
                self.fail(where, f"missing required placeholder ${{{name}}}")
        for name in bulleted_placeholders(raw, ("stages", "facts", "behaviors")):
            if name in allowed:
                self.fail(where, f"${{{name}}} renders its own '- ' bullets; remove the bullet in front of it")
        return substitute(raw, self.vars, keep_unknown=True)

    def texts(self, node: Any, where: str) -> tuple[str, ...]:
        if not isinstance(node, list) or not node:
            self.fail(where, "must be a non-empty list of strings")
        return tuple(self.text(item, f"{where}[{i}]") for i, item in enumerate(node))

    def cues(self, node: Any, where: str) -> CueList:
        items = self.texts(node, where)
        for i, item in enumerate(items):
            try:
                CueList.compile([item])
            except re.error as exc:
                self.fail(f"{where}[{i}]", str(exc))
        return CueList.compile(items)


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def read_scenario_fields(path: str | os.PathLike) -> dict[str, Any]:
    """Validate the scenario YAML at `path` and return the keyword arguments of `Scenario`."""
    file = str(path)
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ScenarioError(file, where, f"YAML syntax error: {getattr(exc, 'problem', None) or exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ScenarioError(file, "", f"cannot read scenario: {exc}") from None
    r = _Reader(file)
    top = r.mapping(raw, "", ("name", "description", "state", "stages", "facts", "agent", "user", "scripted"),
                    ("vars", "statuses", "behavior_library", "behaviors", "diagnosis"))
    schema = StateSchema(_state(r, top["state"]), _statuses(r, top.get("statuses", {})))
    r.vars = _vars(r, top.get("vars", {}), schema.names)
    name = r.raw_str(top["name"], "name")
    if not _SNAKE.fullmatch(name):
        r.fail("name", f"{name!r} must be a snake_case identifier")
    stages = _stages(r, top["stages"])
    scripted = _scripted(r, top["scripted"], schema, [s.id for s in stages])
    description = r.text(top["description"], "description")
    diagnosis = read_diagnosis(r, top["diagnosis"], scripted, schema) if "diagnosis" in top else ()
    return {
        "name": name,
        "description": description,
        "path": file,
        "vars": dict(r.vars),
        "state_schema": schema,
        "stages": stages,
        "facts": r.texts(top["facts"], "facts"),
        "behaviors": _behaviors(r, top, Path(path).parent, scripted.categories),
        "scripted": scripted,
        "diagnosis": diagnosis,
        **_agent(r, top["agent"], description, schema.names),
        **_user(r, top["user"], schema.names),
    }


def _vars(r: _Reader, node: Any, dims: tuple[str, ...]) -> dict[str, str]:
    if not isinstance(node, Mapping):
        r.fail("vars", f"must be a mapping of name -> value, got {type(node).__name__}")
    out = {}
    for key, value in node.items():
        where = f"vars.{key}"
        if not isinstance(key, str) or not is_identifier(key):
            r.fail(where, "a var name must be an identifier")
        if key in AGENT_DYNAMIC or key in USER_FIXED or key in dims:
            r.fail(where, f"{key!r} is a dynamic placeholder name and cannot be a var")
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            r.fail(where, f"must be a string or number, got {value!r}")
        if "${" in str(value):
            r.fail(where, "a var value may not contain placeholders")
        out[key] = str(value)
    return out


def _state(r: _Reader, node: Any) -> tuple[Dimension, ...]:
    """The `state:` section: dimension -> {min, max, [better: higher|lower], [short: letters]}, in file order."""
    if not isinstance(node, Mapping) or not node:
        r.fail("state", "must be a non-empty mapping of dimension -> {min, max}")
    dims, shorts = [], set()
    for dim, spec in node.items():
        where = f"state.{dim}"
        if not isinstance(dim, str) or not _SNAKE.fullmatch(dim) or dim in RESERVED_NAMES:
            r.fail(where, f"a dimension name must be a snake_case identifier other than {list(RESERVED_NAMES)}")
        spec = r.mapping(spec, where, ("min", "max"), ("better", "short"))
        lo, hi = r.integer(spec["min"], f"{where}.min"), r.integer(spec["max"], f"{where}.max")
        if lo >= hi:
            r.fail(where, f"min ({lo}) must be below max ({hi})")
        better = spec.get("better", "higher")
        if better not in BETTER:
            r.fail(f"{where}.better", f"must be one of {list(BETTER)}, got {better!r}")
        short = spec.get("short", dim[0])
        if not isinstance(short, str) or not _SHORT.fullmatch(short):
            r.fail(f"{where}.short", f"must be lower-case letters, got {short!r}")
        if short in shorts:
            r.fail(f"{where}.short", f"{short!r} is another dimension's short name (the state key's prefix): give "
                                     "one of them its own `short`")
        shorts.add(short)
        dims.append(Dimension(dim, StateRange(lo, hi), short, better))
    return tuple(dims)


def _statuses(r: _Reader, node: Any) -> Statuses:
    """The optional `statuses:` section: the status tag's value per role (default completed 1, continue 0,
    ended -1)."""
    node = r.mapping(node, "statuses", (), STATUS_ROLES)
    default = Statuses()
    defaults = {"completed": default.completed, "continue": default.ongoing, "ended": default.ended}
    values = {role: r.integer(node.get(role, defaults[role]), f"statuses.{role}") for role in STATUS_ROLES}
    if len(set(values.values())) != len(values):
        r.fail("statuses", f"the values must be distinct, got {values}")
    return Statuses(values["completed"], values["continue"], values["ended"])


def _stages(r: _Reader, node: Any) -> tuple[Stage, ...]:
    if not isinstance(node, list) or not node:
        r.fail("stages", "must be a non-empty list of {id, name, goal}")
    out, seen = [], set()
    for i, item in enumerate(node):
        where = f"stages[{i}]"
        item = r.mapping(item, where, ("id", "name", "goal"))
        sid = r.integer(item["id"], f"{where}.id")
        if sid < 0 or sid in seen:
            r.fail(f"{where}.id", f"stage ids must be distinct and >= 0, got {sid}")
        seen.add(sid)
        out.append(Stage(sid, r.text(item["name"], f"{where}.name"), r.text(item["goal"], f"{where}.goal")))
    return tuple(out)


def _tags(r: _Reader, node: Any, where: str, roles: dict[str, tuple[str, ...]]) -> TagProtocol:
    node = r.mapping(node, where, roles["required"], roles["optional"])
    tags, abouts = {}, {}
    for role, spec in node.items():
        spec = r.mapping(spec, f"{where}.{role}", ("tag", "about"))
        tag = r.raw_str(spec["tag"], f"{where}.{role}.tag")
        if not is_identifier(tag):
            r.fail(f"{where}.{role}.tag", f"{tag!r} is not a valid tag name")
        if tag.lower() in (t.lower() for t in tags.values()):
            r.fail(f"{where}.{role}.tag", f"tag <{tag}> is used twice")
        tags[role], abouts[role] = tag, r.text(spec["about"], f"{where}.{role}.about")
    return TagProtocol(tags, abouts)


def _agent(r: _Reader, node: Any, description: str, dims: tuple[str, ...]) -> dict[str, Any]:
    node = r.mapping(node, "agent", ("system_prompt", "opening", "tags"), ("compact_prompt",))
    compact = (r.text(node["compact_prompt"], "agent.compact_prompt") if "compact_prompt" in node
               else f"{' '.join(description.split())} Answer in the tags.")
    return {
        "agent_template": r.template(node["system_prompt"], "agent.system_prompt", AGENT_DYNAMIC, AGENT_DYNAMIC),
        "agent_opening": r.text(node["opening"], "agent.opening"),
        "agent_tags": _tags(r, node["tags"], "agent.tags",
                            {"required": (*AGENT_FIXED_ROLES, *dims), "optional": ("think",)}),
        "agent_compact_prompt": " ".join(compact.split()),
    }


def _user(r: _Reader, node: Any, dims: tuple[str, ...]) -> dict[str, Any]:
    node = r.mapping(node, "user", ("persona", "tags"), ("no_behaviors", "silent_agent"))
    dynamic = (*dims, *USER_FIXED)
    return {
        "user_template": r.template(node["persona"], "user.persona", dynamic, dynamic),
        "user_tags": _tags(r, node["tags"], "user.tags", {"required": (*USER_FIXED_ROLES, *dims),
                                                          "optional": ("think",)}),
        "no_behaviors": r.text(node.get("no_behaviors", "- nothing in particular"), "user.no_behaviors"),
        "silent_agent": r.text(node.get("silent_agent", "(silence on the line)"), "user.silent_agent"),
    }


def _behaviors(r: _Reader, top: dict, base: Path, categories: Collection[str]) -> tuple[Behavior, ...]:
    has_lib, has_inline = "behavior_library" in top, "behaviors" in top
    if has_lib == has_inline:
        r.fail("behavior_library", "give exactly one of 'behavior_library' (a JSONL path) or 'behaviors' (a list)")
    if has_lib:
        rel = r.raw_str(top["behavior_library"], "behavior_library")
        lib = (base / rel).resolve()
        if not lib.is_file():
            r.fail("behavior_library", f"no such file {lib} (relative paths are resolved against the scenario file)")
        return tuple(load_behavior_library(lib, categories))
    if not isinstance(top["behaviors"], list) or not top["behaviors"]:
        r.fail("behaviors", "must be a non-empty list of {category, behavior}")
    return tuple(_behavior(item, r.file, f"behaviors[{i}]", categories) for i, item in enumerate(top["behaviors"]))


def _scripted(r: _Reader, node: Any, schema: StateSchema, stage_ids: list[int]) -> ScriptedSpec:
    w = "scripted"
    node = r.mapping(node, w, ("cues", "stage_cues", "steps", "categories", "lines", "effects", "rules"))
    cue_node = r.mapping(node["cues"], f"{w}.cues", CUE_KEYS)
    cues = {k: r.cues(cue_node[k], f"{w}.cues.{k}") for k in CUE_KEYS}
    sc = node["stage_cues"]
    if not isinstance(sc, Mapping) or set(sc) != set(stage_ids):
        got = sorted(sc) if isinstance(sc, Mapping) else sc
        r.fail(f"{w}.stage_cues", f"must map exactly the stage ids {sorted(stage_ids)} to cue lists, got {got}")
    stage_cues = {sid: r.cues(sc[sid], f"{w}.stage_cues.{sid}") for sid in stage_ids}
    if not isinstance(node["steps"], list) or not node["steps"]:
        r.fail(f"{w}.steps", "must be a non-empty list of {id, name, guide, done}")
    steps, seen = [], set()
    for i, item in enumerate(node["steps"]):
        where = f"{w}.steps[{i}]"
        item = r.mapping(item, where, ("id", "name", "guide", "done"))
        sid = r.raw_str(item["id"], f"{where}.id")
        if not _SNAKE.fullmatch(sid) or sid in seen:
            r.fail(f"{where}.id", f"step ids must be distinct snake_case ids, got {sid!r}")
        seen.add(sid)
        steps.append(ScriptedStep(sid, r.text(item["name"], f"{where}.name"), r.cues(item["guide"], f"{where}.guide"),
                                  r.texts(item["done"], f"{where}.done")))
    cat_node = node["categories"]
    if not isinstance(cat_node, Mapping) or not cat_node:
        r.fail(f"{w}.categories", "must be a non-empty mapping of category id -> {doubt, resolve}")
    categories = {}
    for cat, spec in cat_node.items():
        where = f"{w}.categories.{cat}"
        if not isinstance(cat, str) or not _SNAKE.fullmatch(cat):
            r.fail(where, "category ids must be snake_case")
        spec = r.mapping(spec, where, ("doubt", "resolve"))
        categories[cat] = CategoryScript(r.texts(spec["doubt"], f"{where}.doubt"),
                                         r.cues(spec["resolve"], f"{where}.resolve"))
    line_node = r.mapping(node["lines"], f"{w}.lines", LINE_KEYS, OPTIONAL_LINE_KEYS)
    lines = {k: r.texts(line_node[k], f"{w}.lines.{k}") for k in LINE_KEYS}
    lines["overloaded"] = (r.texts(line_node["overloaded"], f"{w}.lines.overloaded") if "overloaded" in line_node
                           else lines["confused"])
    return ScriptedSpec(cues, stage_cues, tuple(steps), categories, lines, _effects(r, node["effects"], schema),
                        _rules(r, node["rules"], schema))


def _effects(r: _Reader, node: Any, schema: StateSchema) -> dict[str, dict[str, int]]:
    node = r.mapping(node, "scripted.effects", (), EVENTS)
    out = {}
    for event in EVENTS:
        where = f"scripted.effects.{event}"
        deltas = r.mapping(node.get(event, {}), where, (), schema.names)
        out[event] = {dim: r.integer(deltas.get(dim, 0), f"{where}.{dim}") for dim in schema.names}
        for dim, delta in out[event].items():
            span = schema[dim].span
            if abs(delta) > span:
                r.fail(f"{where}.{dim}", f"delta {delta} exceeds the whole {dim} range ({span})")
    return out


def _rules(r: _Reader, node: Any, schema: StateSchema) -> ScriptedRules:
    w = "scripted.rules"
    gates = tuple(f"act_{bound}_{dim}" for dim in schema.names for bound in ("min", "max"))
    node = r.mapping(node, w, ("hang_up_at", "doubt_patience"), ("max_words", "max_topics", *gates))
    hang = r.mapping(node["hang_up_at"], f"{w}.hang_up_at", (), schema.names)
    hang_up_at = {}
    for dim, value in hang.items():
        hang_up_at[dim] = r.integer(value, f"{w}.hang_up_at.{dim}")
        if not schema[dim].range.contains(hang_up_at[dim]):
            r.fail(f"{w}.hang_up_at.{dim}", f"{value} is outside the {dim} range")
    patience = r.integer(node["doubt_patience"], f"{w}.doubt_patience")
    if patience < 1:
        r.fail(f"{w}.doubt_patience", "must be >= 1")
    limits: dict[str, Any] = {"act_min": {}, "act_max": {}}
    for key in ("max_words", "max_topics"):
        if key in node:
            limits[key] = r.integer(node[key], f"{w}.{key}")
            if limits[key] < 1:
                r.fail(f"{w}.{key}", "must be >= 1")
    for key in gates:
        if key in node:
            bound, dim = key[len("act_"):].split("_", 1)
            value = r.integer(node[key], f"{w}.{key}")
            if not schema[dim].range.contains(value):
                r.fail(f"{w}.{key}", f"{value} is outside the {dim} range")
            limits[f"act_{bound}"][dim] = value
    return ScriptedRules(hang_up_at, patience, **limits)
