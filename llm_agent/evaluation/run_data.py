"""Find a run's files and read them: per-step training metrics, validation metrics and dialogue logs.

A *run* is what `scripts/main.sh` leaves under its output directory (default `outputs/`) for one experiment:

    outputs/logs/<experiment>/metrics.jsonl         one JSON object per training step (the jsonl tracking backend)
    outputs/evaluation/<experiment>/val_metrics.jsonl   one {"step", "n_dialogues", "metrics"} line per validation
                                                    (outputs/evaluation/val_metrics.jsonl: the config's default)
    outputs/rollouts/<experiment>/rollouts.jsonl    one line per dialogue (llm_agent.rollout.records.log_lines)

`resolve_run` accepts that output root (its most recently written experiment is taken), a log directory, a
`metrics.jsonl`, a rollout log or an evaluation's `<name>_dialogues.jsonl` (same line format as the rollout
log), or a directory holding one of those. Calls a person played (`python -m for_evaluation.chat`:
`human_dialogues.jsonl`, lines with a `judge`) beside an evaluation's dialogues come along (`RunFiles.human`); a
line with a `judge` reads back with the split `<split>@<judge>`, so a report shows those calls as a group of
their own beside the simulated ones. Every reader names the file and line of a bad line.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from llm_agent.evaluation.dialogue_log import latest_per_dialogue, read_dialogue_log
from llm_agent.rollout.dialogue_record import DialogueRecord

logger = logging.getLogger(__name__)

__all__ = ["RunFiles", "default_plot_dir", "find_latest_run", "output_root", "read_dialogue_summaries",
           "judged_split", "read_dialogues", "read_jsonl", "read_step_metrics", "read_val_metrics", "resolve_run"]

METRICS_FILE = "metrics.jsonl"
ROLLOUT_FILE = "rollouts.jsonl"
VAL_FILE = "val_metrics.jsonl"
DIALOGUES_SUFFIX = "_dialogues.jsonl"
HUMAN_DIALOGUES = "human_dialogues.jsonl"  # for_evaluation/chat.py's calls
_PROGRESS_BYTES = 32 << 20  # show a progress bar when reading files larger than this


@dataclass(frozen=True)
class RunFiles:
    """The files of one run (any may be None) and the name plots and reports call it by."""

    name: str
    metrics: Path | None = None
    val_metrics: Path | None = None
    dialogues: Path | None = None
    human: tuple[Path, ...] = ()  # dialogue files of calls a person played, shown beside `dialogues`

    def describe(self) -> str:
        """One line per file that was found, for logs and the report header."""
        parts = [f"{label}: {path}" for label, path in (("training metrics", self.metrics),
                 ("validation metrics", self.val_metrics), ("dialogues", self.dialogues),
                 *(("human calls", path) for path in self.human)) if path is not None]
        return "; ".join(parts) if parts else "no files"


def _first_existing(*candidates: Path) -> Path | None:
    return next((p for p in candidates if p.is_file()), None)


def _run_from_log_dir(log_dir: Path) -> RunFiles:
    """A main.sh log directory `<root>/logs/<experiment>` and the sibling files main.sh writes for it."""
    name = log_dir.name
    root = log_dir.parent.parent
    rollouts = _first_existing(log_dir / ROLLOUT_FILE, root / "rollouts" / name / ROLLOUT_FILE)
    val = _first_existing(log_dir / VAL_FILE, root / "evaluation" / name / VAL_FILE, root / "evaluation" / VAL_FILE)
    return RunFiles(name=name, metrics=log_dir / METRICS_FILE, val_metrics=val, dialogues=rollouts)


def _run_from_dialogues(path: Path) -> RunFiles:
    """A rollout log or an evaluation's dialogues file; a rollout log under `<root>/rollouts/<experiment>/`
    brings that experiment's metrics along."""
    if path.name.endswith(DIALOGUES_SUFFIX):
        human = path.parent / HUMAN_DIALOGUES
        extra = (human,) if human.is_file() and path.name != HUMAN_DIALOGUES else ()
        return RunFiles(name=path.name[:-len(DIALOGUES_SUFFIX)], dialogues=path, human=extra)
    name = path.parent.name
    log_dir = path.parent.parent.parent / "logs" / name
    if path.parent.parent.name == "rollouts" and (log_dir / METRICS_FILE).is_file():
        return _run_from_log_dir(log_dir)
    return RunFiles(name=name, dialogues=path)


def find_latest_run(root: str | Path = "outputs") -> RunFiles:
    """The experiment under a main.sh output root whose metrics.jsonl was written last.

    FileNotFoundError saying what was looked for when there is none (e.g. before `make demo`).
    """
    root = Path(root)
    candidates = sorted(root.glob(f"logs/*/{METRICS_FILE}"), key=lambda p: p.stat().st_mtime)
    if not candidates:
        rollouts = sorted(root.glob(f"rollouts/*/{ROLLOUT_FILE}"), key=lambda p: p.stat().st_mtime)
        if rollouts:
            return _run_from_dialogues(rollouts[-1])
        raise FileNotFoundError(f"no run under {root}/: looked for {root}/logs/<experiment>/{METRICS_FILE} and "
                                f"{root}/rollouts/<experiment>/{ROLLOUT_FILE}; run `make demo` first or pass --run")
    return _run_from_log_dir(candidates[-1].parent)


def resolve_run(path: str | Path) -> RunFiles:
    """The run that `path` names (see the module docstring); FileNotFoundError naming what was looked for."""
    path = Path(path)
    if path.is_file():
        if path.name == METRICS_FILE:
            return _run_from_log_dir(path.parent)
        if path.suffix == ".jsonl":
            return _run_from_dialogues(path)
        raise FileNotFoundError(f"{path} is neither a {METRICS_FILE}, a {ROLLOUT_FILE} nor a *{DIALOGUES_SUFFIX}")
    if not path.is_dir():
        raise FileNotFoundError(f"run {path} does not exist")
    if (path / METRICS_FILE).is_file():
        return _run_from_log_dir(path)
    if (path / ROLLOUT_FILE).is_file():
        return _run_from_dialogues(path / ROLLOUT_FILE)
    evaluations = sorted(path.glob(f"*{DIALOGUES_SUFFIX}"))
    if len(evaluations) > 1:  # the person's calls ride along with the one simulated evaluation
        evaluations = [p for p in evaluations if p.name != HUMAN_DIALOGUES]
    if len(evaluations) == 1:
        return _run_from_dialogues(evaluations[0])
    if len(evaluations) > 1:
        raise FileNotFoundError(f"{path} holds several evaluations ({', '.join(p.name for p in evaluations)}); "
                                "name one file")
    return find_latest_run(path)


def read_jsonl(path: str | Path, desc: str | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line; ValueError naming file and line for a bad one.

    A last line without its newline that does not parse is skipped with a warning: it is a write that a
    killed run left half done.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, encoding="utf-8") as f, tqdm(total=size, unit="B", unit_scale=True, desc=desc or path.name,
                                                 disable=size < _PROGRESS_BYTES, leave=False) as bar:
        for number, line in enumerate(f, start=1):
            bar.update(len(line.encode("utf-8")))
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                if not line.endswith("\n"):
                    logger.warning("%s:%d: skipped an incomplete last line (%s)", path, number, exc)
                    return
                raise ValueError(f"{path}:{number}: not valid JSON ({exc})") from None
            if not isinstance(value, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object, got {type(value).__name__}")
            yield number, value


def read_step_metrics(path: str | Path) -> list[dict[str, float]]:
    """The tracked metrics as one dict per step, sorted by step. A step logged twice (a resumed run) keeps
    its last line; non-numeric values are errors naming file, line and key."""
    by_step: dict[int, dict[str, float]] = {}
    for number, row in read_jsonl(path):
        step = row.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"{path}:{number}: 'step' must be an integer, got {step!r}")
        for key, value in row.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{path}:{number}: metric {key!r} must be a number, got {value!r}")
        by_step[step] = {k: float(v) for k, v in row.items()}
    return [by_step[s] for s in sorted(by_step)]


def read_val_metrics(path: str | Path) -> list[dict[str, float]]:
    """val_metrics.jsonl as one dict per validation, `step` plus the dialogue metrics under `val/dialogue/`
    (the names the trainer tracks them by), each judge's under `val/<judge>/` and `val/exploitation_gap` (when
    validation ran judges), sorted by step; the last line of a repeated step wins."""
    by_step: dict[int, dict[str, float]] = {}
    for number, row in read_jsonl(path):
        step, metrics = row.get("step"), row.get("metrics")
        if isinstance(step, bool) or not isinstance(step, int) or not isinstance(metrics, dict):
            raise ValueError(f"{path}:{number}: expected {{'step': int, 'metrics': {{...}}}}, got keys {sorted(row)}")
        by_step[step] = {"step": float(step), **{f"val/dialogue/{k}": float(v) for k, v in metrics.items()},
                         **_judge_rows(row, f"{path}:{number}")}
    return [by_step[s] for s in sorted(by_step)]


def _judge_rows(row: dict[str, Any], where: str) -> dict[str, float]:
    """A validation line's judge metrics as `val/<judge>/<metric>` and its `val/exploitation_gap`."""
    judges, gap = row.get("judges", {}), row.get("exploitation_gap")
    if not isinstance(judges, dict):
        raise ValueError(f"{where}: 'judges' must be an object, got {type(judges).__name__}")
    out: dict[str, float] = {}
    for name, judged in judges.items():
        metrics = judged.get("metrics") if isinstance(judged, dict) else None
        if not isinstance(metrics, dict) or not all(_is_number(v) for v in metrics.values()):
            raise ValueError(f"{where}: judge {name!r} needs {{'metrics': {{name: number}}}}")
        out.update({f"val/{name}/{k}": float(v) for k, v in metrics.items()})
    if gap is not None:
        if not _is_number(gap):
            raise ValueError(f"{where}: 'exploitation_gap' must be a number or null, got {gap!r}")
        out["val/exploitation_gap"] = float(gap)
    return out


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def read_dialogues(path: str | Path) -> list[DialogueRecord]:
    """Every dialogue of a rollout log or an evaluation's dialogues file (read by `dialogue_log`, which skips a
    torn last line), as `DialogueRecord`s. In an evaluation's file a dialogue run again (an error retried on
    resume) counts once, as its last record. Lines must hold `outcome`, `profile` and `turns` (log_lines' format);
    ValueError naming file and line otherwise."""
    path = Path(path)
    log = read_dialogue_log(path)
    for number, row in zip(log.line_numbers, log.records):
        missing = [k for k in ("outcome", "profile", "turns") if k not in row]
        if missing:
            raise ValueError(f"{path}:{number}: dialogue {row.get('dialogue_id')!r} has no {missing} "
                             "(see llm_agent/rollout/dialogue_record.py)")
    numbers = {id(row): number for number, row in zip(log.line_numbers, log.records)}
    rows = log.records
    if path.name.endswith(DIALOGUES_SUFFIX):
        warn_on_foreign_repeats(path, [(r.get("dialogue_id"), r.get("step"), judged_split(r).get("split"))
                                       for r in rows])
        rows = list(latest_per_dialogue(rows).values())
    return [DialogueRecord.from_dict(judged_split(row), f"{path}:{numbers[id(row)]}") for row in rows]


def judged_split(row: dict[str, Any]) -> dict[str, Any]:
    """A dialogue line whose `judge` is set (a person's call, `judge: human`) with the split `<split>@<judge>`."""
    judge = row.get("judge")
    if isinstance(judge, str) and judge and not str(row.get("split")).endswith(f"@{judge}"):
        return {**row, "split": f"{row.get('split') or 'eval'}@{judge}"}
    return row


def read_dialogue_summaries(path: str | Path) -> list[DialogueRecord]:
    """What the plots need of each dialogue (`dialogue_id`, `step`, `split`, `outcome`, and the profile's initial
    state without its behaviours), as records without turns, read line by line so a long run's rollout log is
    never held whole. Deduplicated like `read_dialogues`; ValueError naming file and line for a line without
    outcome or profile."""
    path = Path(path)
    out = []
    for number, row in read_jsonl(path, desc="reading dialogues"):
        profile = row.get("profile")
        if "outcome" not in row or not isinstance(profile, dict):
            raise ValueError(f"{path}:{number}: a dialogue line needs 'outcome' and a 'profile' object "
                             "(see llm_agent/rollout/dialogue_record.py)")
        summary = {"dialogue_id": row.get("dialogue_id"), "step": row.get("step"),
                   "split": judged_split(row).get("split"),
                   "outcome": row["outcome"], "turns": [],
                   "profile": {k: v for k, v in profile.items() if k != "behaviors"}}
        out.append(DialogueRecord.from_dict(summary, f"{path}:{number}"))
    if path.name.endswith(DIALOGUES_SUFFIX):
        warn_on_foreign_repeats(path, [(r.dialogue_id, r.step, r.split) for r in out])
        out = list({r.dialogue_id: r for r in out}.values())
    return out


def warn_on_foreign_repeats(path: Path, keys: list[tuple[Any, Any, Any]]) -> None:
    """Warn when an evaluation file's dialogue id repeats with another step or split: not a retried dialogue
    (which repeats all three) but lines of several runs, of which only the last per id will count."""
    first: dict[Any, tuple[Any, Any]] = {}
    foreign = 0
    for dialogue_id, step, split in keys:
        foreign += first.setdefault(dialogue_id, (step, split)) != (step, split)
    if foreign:
        logger.warning("%s: %d of %d lines repeat a dialogue id with another step or split; a file named "
                       "*%s counts only the last line per id (a retried dialogue), so give lines of several "
                       "runs another file name to keep them all", path, foreign, len(keys), DIALOGUES_SUFFIX)


def output_root(files: RunFiles) -> Path:
    """Where derived files (plots, reports) of a run go: the main.sh output root of its metrics
    (`<root>/logs/<experiment>/metrics.jsonl`), else the directory of its dialogues file."""
    if files.metrics is not None:
        return files.metrics.parent.parent.parent
    if files.dialogues is not None:
        return files.dialogues.parent
    return Path("outputs")


def default_plot_dir(runs: list[RunFiles]) -> Path:
    """`<root>/plots/<name>` for one run, `<root>/plots/compare_<a>_vs_<b>...` for several (root of the first)."""
    if not runs:
        raise ValueError("default_plot_dir needs at least one run")
    name = runs[0].name if len(runs) == 1 else "compare_" + "_vs_".join(r.name for r in runs)
    return output_root(runs[0]) / "plots" / name
