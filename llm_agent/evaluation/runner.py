"""Evaluate one agent on the fixed test set through the training rollout loop, resumably.

The test set is the `test.parquet` of `utils/create_prompt_data.py` (agent prompt and a fixed `user_profile` per
row), tokenized by the trainer's own `RLHFDataset`. Row i becomes dialogue `test{i}#0`. Dialogues run in chunks
of `chunk_size` through `llm_agent.generation.LLMGenerationManager` in validation mode (`is_validation=True`:
fixed profiles, no cache, no controller, simulator seeds from the profile) with greedy decoding, so scenario
parsing, outcomes and metrics are the training ones. Each finished chunk is scored by the dialogue reward
(`llm_agent.reward.compute_reward`, default weights) and appended to `<out>/<name>_dialogues.jsonl` in the
rollout log's line format (split `eval`, step: the agent's training step), each line with the settings it was run
with (`settings`, the fingerprint of `EvalSettings`; `<name>_settings.json` holds them too). A rerun reads that
file, moves a torn last line to `<name>_dialogues.jsonl.torn`, checks every line's settings (a line without them
only when the settings file is there and matches) and step, and the profiles, and runs only the dialogue ids that
are missing (with `retry_errors`, also those whose last run ended in `error`); a line run under other settings or
at another step is an error naming the file and the line, never counted. API keys are never settings: they reach
the simulator client through `evaluate_agent(user_sim_api_key=...)` or its environment. At the end
`<out>/<name>_results.json` gets every metric of `llm_agent.metrics` with its bootstrap interval
(`llm_agent.evaluation.stats`), and for a checkpoint agent the checkpoint, its `global_step` and where each setting
came from.
"""
from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from llm_agent.evaluation.defaults import DEFAULT_CONFIDENCE, DEFAULT_RESAMPLES
from llm_agent.evaluation.dialogue_log import drop_torn_tail, latest_per_dialogue, read_dialogue_log
from llm_agent.evaluation.stats import metric_intervals
from llm_agent.generation import LLMGenerationManager
from llm_agent.reward import compute_reward
from llm_agent.rollout.config import GenerationConfig
from llm_agent.rollout.dialogue_record import DialogueRecord, records_from_batch
from llm_agent.rollout.records import append_jsonl, log_lines, object_column
from llm_agent.scenario import load_scenario
from verl.utils.dataset import RLHFDataset
from verl.utils.untrusted import load_json
from verl.workers.rollout.engine import RolloutEngine

logger = logging.getLogger(__name__)

__all__ = ["EvalSettings", "EvalSummary", "dialogue_id_of", "dialogues_path", "evaluate_agent", "results_path"]

SPLIT = "eval"
SETTINGS_KEY = "settings"  # each dialogue line's copy of the settings fingerprint
ANOTHER_NAME = "name the agent differently (--agent NEWNAME=SPEC) or use another --out"  # a refusal's advice


def dialogues_path(out_dir: str | os.PathLike, name: str) -> Path:
    """`<out>/<name>_dialogues.jsonl`."""
    return Path(out_dir) / f"{name}_dialogues.jsonl"


def results_path(out_dir: str | os.PathLike, name: str) -> Path:
    """`<out>/<name>_results.json`."""
    return Path(out_dir) / f"{name}_results.json"


def settings_path(out_dir: str | os.PathLike, name: str) -> Path:
    """`<out>/<name>_settings.json`: what the dialogues were run with (checked on resume)."""
    return Path(out_dir) / f"{name}_settings.json"


def dialogue_id_of(row: int) -> str:
    """The dialogue id of test-set row `row` (its uid is `test<row>`, the rollout loop adds `#0`)."""
    return f"test{row}#0"


@dataclass
class EvalSettings:
    """What decides the dialogues: the test set, the rollout-loop settings and the decoding.

    `loop` is the rollout-loop config mapping (`rollout_loop.config` keys) without `user_sim.urls`; cache and
    controller are always off. Changing any field but `max_dialogues` between a run and its resume is refused.
    """

    scenario: str
    test_file: str
    max_dialogues: int = 1000
    max_prompt_length: int = 4096
    max_turns: int = GenerationConfig.max_turns
    max_tokens_per_turn: int = GenerationConfig.max_tokens_per_turn
    max_response_length: int = GenerationConfig.max_response_length
    max_user_tokens: int = GenerationConfig.max_user_tokens
    seed: int = GenerationConfig.seed
    user_sim: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if "api_key" in self.user_sim:
            raise ValueError("EvalSettings.user_sim must not hold an API key (settings are written to files); pass "
                             "it to evaluate_agent(user_sim_api_key=...) or set SEAD_USER_SIM_API_KEY")

    def loop_config(self, urls: list[str] | None, api_key: str | None = None) -> dict[str, Any]:
        """The `rollout_loop.config` mapping for LLMGenerationManager (validated there, key by key)."""
        return {"scenario": self.scenario, "max_turns": self.max_turns, "max_tokens_per_turn": self.max_tokens_per_turn,
                "max_response_length": self.max_response_length, "max_user_tokens": self.max_user_tokens,
                "seed": self.seed, "user_sim": {**self.user_sim, "urls": urls, "api_key": api_key},
                "cache": {"enabled": False}, "controller": {"enabled": False}}

    def fingerprint(self) -> dict[str, Any]:
        """The settings that decide each dialogue, JSON-ready (what `<name>_settings.json` holds); `max_dialogues`
        is left out, so a later run may extend the selection (each dialogue's profile is checked instead)."""
        values = json.loads(json.dumps(asdict(self)))
        values.pop("max_dialogues")
        return values


@dataclass
class EvalSummary:
    """Where an evaluation wrote, how many dialogues it ran now and how many it found done."""

    name: str
    dialogues_file: Path
    results_file: Path
    n_selected: int
    n_run: int
    n_resumed: int
    results: dict[str, Any]


def _differences(saved: Any, current: dict[str, Any]) -> str:
    """The settings that differ between `saved` and `current`, then and now ("" when they are equal)."""
    if not isinstance(saved, dict):
        return f"not a settings object but {type(saved).__name__}"
    changed = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
    if not changed:
        return ""
    return (f"{', '.join(changed)}: { {k: saved.get(k) for k in changed} } then, "
            f"{ {k: current.get(k) for k in changed} } now")


def _saved_settings(out_dir: Path, name: str, current: dict[str, Any]) -> bool:
    """True when `<name>_settings.json` exists (and equals `current`); ValueError naming the file otherwise."""
    path = settings_path(out_dir, name)
    if not path.is_file():
        return False
    saved = load_json(path.read_bytes(), what=str(path), max_bytes=1 << 20)
    if changed := _differences(saved, current):
        raise ValueError(f"{path}: the dialogues of {name!r} were run with other settings ({changed}); {ANOTHER_NAME} "
                         "to evaluate with new settings")
    return True


def _done_records(path: Path, profiles: Mapping[str, str], retry_errors: bool, current: dict[str, Any],
                  settings_file: bool, step: int) -> dict[str, DialogueRecord]:
    """The finished dialogues of a previous run that belong to this test selection, each line checked against the
    current settings (a line without settings only when the settings file matched) and the agent's step (a
    checkpoint root trained on since then is another agent), and the test set's profiles."""
    if not path.is_file():
        return {}
    log = read_dialogue_log(path)
    drop_torn_tail(log)
    for lineno, record in zip(log.line_numbers, log.records):
        if SETTINGS_KEY not in record:
            if not settings_file:
                raise ValueError(f"{path}:{lineno}: the line does not record its settings and "
                                 f"{settings_path(path.parent, path.name.removesuffix('_dialogues.jsonl'))} is "
                                 "missing, so what it was run with is unknown; evaluate into another --out")
        elif changed := _differences(record[SETTINGS_KEY], current):
            raise ValueError(f"{path}:{lineno}: dialogue {record.get('dialogue_id')} was run with other settings "
                             f"({changed}); {ANOTHER_NAME}")
        if record.get("step") != step:
            raise ValueError(f"{path}:{lineno}: dialogue {record.get('dialogue_id')} was run with the agent at step "
                             f"{record.get('step')}, but it is now at step {step} (trained on since?); {ANOTHER_NAME}")
    done = {}
    for dialogue_id, record in latest_per_dialogue(log.records).items():
        if dialogue_id not in profiles:
            continue
        if json.dumps(record.get("profile"), sort_keys=True) != profiles[dialogue_id]:
            raise ValueError(f"{path}: dialogue {dialogue_id} has profile {record.get('profile')} but the test set "
                             f"has {profiles[dialogue_id]}; the file belongs to another test set")
        if retry_errors and record.get("outcome") == "error":
            continue
        done[dialogue_id] = DialogueRecord.from_dict(record, f"{path}: dialogue {dialogue_id}")
    return done


def _with_settings(lines: list[str], current: dict[str, Any]) -> list[str]:
    """The log lines, each with the settings it was run with."""
    return [json.dumps({**json.loads(line), SETTINGS_KEY: current}, ensure_ascii=False) for line in lines]


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(tmp, path)


def evaluate_agent(name: str, agent: RolloutEngine, tokenizer: Any, settings: EvalSettings, out_dir: str | os.PathLike,
                   user_sim_urls: list[str] | None = None, client: Any = None, chunk_size: int = 64,
                   retry_errors: bool = False, n_resamples: int = DEFAULT_RESAMPLES,
                   confidence: float = DEFAULT_CONFIDENCE, agent_description: str | None = None,
                   step: int = 0, checkpoint: str | None = None,
                   settings_origin: Mapping[str, str] | None = None,
                   user_sim_api_key: str | None = None) -> EvalSummary:
    """Run the missing test dialogues of agent `name` and write its dialogues and results (module docstring).

    `agent` is the agent's rollout engine; `client` (optional) replaces the simulator client built from
    `user_sim_urls` (with `user_sim_api_key`, else $SEAD_USER_SIM_API_KEY). `step` is the agent's training step
    (its dialogues' `step`); `checkpoint` the `global_step_N` directory of a checkpoint agent (results then record
    it and `global_step`); `settings_origin` says where each setting came from. Returns what was run and the
    results written.
    """
    out_dir = Path(out_dir)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    current = settings.fingerprint()
    settings_file = _saved_settings(out_dir, name, current)
    scenario = load_scenario(settings.scenario)
    dataset = RLHFDataset(settings.test_file, tokenizer, max_prompt_length=settings.max_prompt_length)
    if "user_profile" not in dataset.columns:
        raise ValueError(f"{settings.test_file}: no 'user_profile' column; write the test set with "
                         "utils/create_prompt_data.py")
    rows = list(range(min(settings.max_dialogues, len(dataset))))
    profiles = {dialogue_id_of(i): json.dumps(json.loads(dataset.rows[i]["user_profile"]), sort_keys=True)
                for i in rows}
    log_path = dialogues_path(out_dir, name)
    done = _done_records(log_path, profiles, retry_errors, current, settings_file, step)
    if not settings_file:
        out_dir.mkdir(parents=True, exist_ok=True)
        _write_json(settings_path(out_dir, name), current)
    todo = [i for i in rows if dialogue_id_of(i) not in done]
    logger.info("%s: %d test dialogues, %d already in %s, %d to run", name, len(rows), len(done), log_path, len(todo))
    if todo:
        loop = LLMGenerationManager(tokenizer, agent, settings.loop_config(user_sim_urls, user_sim_api_key),
                                    is_validation=True, client=client)
        progress = tqdm(total=len(rows), initial=len(done), desc=f"evaluating {name}", unit="dialogue")
        try:
            for start in range(0, len(todo), chunk_size):
                chunk = todo[start:start + chunk_size]
                batch = dataset.collate(chunk)
                batch.non_tensor_batch["uid"] = object_column([f"test{i}" for i in chunk])
                batch.meta_info = {"do_sample": False, "validate": True}
                out = loop.run_llm_loop(batch)
                compute_reward(out, tokenizer, scenario=settings.scenario)
                records = records_from_batch(out)
                append_jsonl(log_path, _with_settings(log_lines(records, step, SPLIT), current))
                done.update({r.dialogue_id: r for r in records})
                progress.update(len(chunk))
        finally:
            progress.close()
            loop.close()
    selected = [done[dialogue_id_of(i)] for i in rows]
    intervals = metric_intervals(selected, scenario, n_resamples=n_resamples, confidence=confidence,
                                 seed=settings.seed)
    results = {"name": name, "agent": agent_description or name, "split": SPLIT, "step": step,
               "scenario": settings.scenario, "test_file": settings.test_file, "n_dialogues": len(selected),
               "dialogues_file": log_path.name, "outcomes": dict(Counter(r.outcome for r in selected)),
               "checkpoint": checkpoint, "global_step": step if checkpoint is not None else None,
               "confidence": confidence, "n_resamples": n_resamples,
               "interval_method": "percentile bootstrap over dialogues",
               "metrics": {key: interval.to_dict() for key, interval in intervals.items()},
               "settings": {**settings.fingerprint(), "max_dialogues": settings.max_dialogues},
               "settings_origin": dict(settings_origin or {})}
    _write_json(results_path(out_dir, name), results)
    return EvalSummary(name=name, dialogues_file=log_path, results_file=results_path(out_dir, name),
                       n_selected=len(rows), n_run=len(todo), n_resumed=len(rows) - len(todo), results=results)
