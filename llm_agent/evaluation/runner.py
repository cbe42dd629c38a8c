"""Evaluate one agent on the fixed test set through the training rollout loop, resumably.

The test set is the `test.parquet` of `utils/create_prompt_data.py` (agent prompt and a fixed `user_profile` per
row), tokenized by the trainer's own `RLHFDataset`. Row i becomes dialogue `test{i}#0`. Dialogues run in chunks
of `chunk_size` through `llm_agent.generation.LLMGenerationManager` in validation mode (`is_validation=True`:
fixed profiles, no cache, no controller, simulator seeds from the profile) with greedy decoding, so scenario
parsing, outcomes and metrics are the training ones. Each finished chunk is scored by the dialogue reward
(`llm_agent.reward.compute_reward`, default weights) and appended to `<out>/<name>_dialogues.jsonl` in the
rollout log's line format (split `eval`, step: the agent's training step). A rerun reads that file, cuts a torn
last line, checks that the recorded settings, profiles and step match, and runs only the dialogue ids that are
missing (with `retry_errors`, also those whose last run ended in `error`). At the end `<out>/<name>_results.json`
gets every metric of `llm_agent.metrics` with its bootstrap interval (`llm_agent.evaluation.stats`), and for a
checkpoint agent the checkpoint, its `global_step` and where each setting came from.
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

from llm_agent.evaluation.dialogue_log import drop_torn_tail, latest_per_dialogue, read_dialogue_log
from llm_agent.evaluation.defaults import DEFAULT_CONFIDENCE, DEFAULT_RESAMPLES
from llm_agent.evaluation.stats import metric_intervals
from llm_agent.generation import LLMGenerationManager
from llm_agent.metrics import records_from_batch
from llm_agent.reward import compute_reward
from llm_agent.rollout.config import GenerationConfig
from llm_agent.rollout.records import RECORD_COLUMNS, append_jsonl, log_lines, object_column
from llm_agent.scenario import load_scenario
from verl.utils.dataset import RLHFDataset

logger = logging.getLogger(__name__)

__all__ = ["EvalSettings", "EvalSummary", "dialogue_id_of", "dialogues_path", "evaluate_agent", "results_path"]

SPLIT = "eval"


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

    def loop_config(self, urls: list[str] | None) -> dict[str, Any]:
        """The `rollout_loop.config` mapping for LLMGenerationManager (validated there, key by key)."""
        return {"scenario": self.scenario, "max_turns": self.max_turns, "max_tokens_per_turn": self.max_tokens_per_turn,
                "max_response_length": self.max_response_length, "max_user_tokens": self.max_user_tokens,
                "seed": self.seed, "user_sim": {**self.user_sim, "urls": urls},
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


def _check_settings(out_dir: Path, name: str, settings: EvalSettings) -> None:
    path = settings_path(out_dir, name)
    current = settings.fingerprint()
    if path.is_file():
        saved = json.loads(path.read_text())
        changed = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
        if changed:
            raise ValueError(f"{path}: the dialogues of {name!r} were run with other settings ({', '.join(changed)}: "
                             f"{ {k: saved.get(k) for k in changed} } then, { {k: current.get(k) for k in changed} } "
                             "now); name the agent differently (--agent NEWNAME=SPEC) or use another --out to evaluate "
                             "with new settings")
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(current, indent=2) + "\n")


def _done_records(path: Path, profiles: Mapping[str, str], retry_errors: bool, step: int
                  ) -> dict[str, dict[str, Any]]:
    """The finished dialogues of a previous run that belong to this test selection, checked against its profiles
    and the agent's step (a checkpoint root trained on since then is another agent)."""
    if not path.is_file():
        return {}
    log = read_dialogue_log(path)
    drop_torn_tail(log)
    done = {}
    for dialogue_id, record in latest_per_dialogue(log.records).items():
        if dialogue_id not in profiles:
            continue
        if json.dumps(record.get("profile"), sort_keys=True) != profiles[dialogue_id]:
            raise ValueError(f"{path}: dialogue {dialogue_id} has profile {record.get('profile')} but the test set "
                             f"has {profiles[dialogue_id]}; the file belongs to another test set")
        if record.get("step") != step:
            raise ValueError(f"{path}: dialogue {dialogue_id} was run with the agent at step {record.get('step')}, "
                             f"but it is now at step {step} (trained on since?); name the agent differently "
                             "(--agent NEWNAME=SPEC) or use another --out")
        if retry_errors and record.get("outcome") == "error":
            continue
        done[dialogue_id] = record
    return done


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(tmp, path)


def evaluate_agent(name: str, agent: Any, tokenizer: Any, settings: EvalSettings, out_dir: str | os.PathLike,
                   user_sim_urls: list[str] | None = None, client: Any = None, chunk_size: int = 64,
                   retry_errors: bool = False, n_resamples: int = DEFAULT_RESAMPLES,
                   confidence: float = DEFAULT_CONFIDENCE, agent_description: str | None = None,
                   step: int = 0, checkpoint: str | None = None,
                   settings_origin: Mapping[str, str] | None = None) -> EvalSummary:
    """Run the missing test dialogues of agent `name` and write its dialogues and results (module docstring).

    `agent` has the worker-group interface; `client` (optional) replaces the simulator client built from
    `user_sim_urls`. `step` is the agent's training step (its dialogues' `step`); `checkpoint` the `global_step_N`
    directory of a checkpoint agent (results then record it and `global_step`); `settings_origin` says where
    each setting came from. Returns what was run and the results written.
    """
    out_dir = Path(out_dir)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    _check_settings(out_dir, name, settings)
    scenario = load_scenario(settings.scenario)
    dataset = RLHFDataset(settings.test_file, tokenizer, max_prompt_length=settings.max_prompt_length)
    if "user_profile" not in dataset.columns:
        raise ValueError(f"{settings.test_file}: no 'user_profile' column; write the test set with "
                         "utils/create_prompt_data.py")
    rows = list(range(min(settings.max_dialogues, len(dataset))))
    profiles = {dialogue_id_of(i): json.dumps(json.loads(dataset.rows[i]["user_profile"]), sort_keys=True)
                for i in rows}
    log_path = dialogues_path(out_dir, name)
    done = _done_records(log_path, profiles, retry_errors, step)
    todo = [i for i in rows if dialogue_id_of(i) not in done]
    logger.info("%s: %d test dialogues, %d already in %s, %d to run", name, len(rows), len(done), log_path, len(todo))
    if todo:
        loop = LLMGenerationManager(tokenizer, agent, settings.loop_config(user_sim_urls), is_validation=True,
                                    client=client)
        progress = tqdm(total=len(rows), initial=len(done), desc=f"evaluating {name}", unit="dialogue")
        try:
            for start in range(0, len(todo), chunk_size):
                chunk = todo[start:start + chunk_size]
                batch = dataset.collate(chunk)
                batch.non_tensor_batch["uid"] = object_column([f"test{i}" for i in chunk])
                batch.meta_info = {"do_sample": False, "validate": True}
                out = loop.run_llm_loop(batch)
                compute_reward(out, tokenizer, scenario=settings.scenario)
                records = records_from_batch(out, RECORD_COLUMNS)
                append_jsonl(log_path, log_lines(records, step, SPLIT))
                done.update({r["dialogue_id"]: r for r in records})
                progress.update(len(chunk))
        finally:
            progress.close()
            loop.close()
    selected = [done[dialogue_id_of(i)] for i in rows]
    intervals = metric_intervals(selected, scenario, n_resamples=n_resamples, confidence=confidence,
                                 seed=settings.seed)
    results = {"name": name, "agent": agent_description or name, "split": SPLIT, "step": step,
               "scenario": settings.scenario, "test_file": settings.test_file, "n_dialogues": len(selected),
               "dialogues_file": log_path.name, "outcomes": dict(Counter(r["outcome"] for r in selected)),
               "checkpoint": checkpoint, "global_step": step if checkpoint is not None else None,
               "confidence": confidence, "n_resamples": n_resamples,
               "interval_method": "percentile bootstrap over dialogues",
               "metrics": {key: interval.to_dict() for key, interval in intervals.items()},
               "settings": {**settings.fingerprint(), "max_dialogues": settings.max_dialogues},
               "settings_origin": dict(settings_origin or {})}
    _write_json(results_path(out_dir, name), results)
    return EvalSummary(name=name, dialogues_file=log_path, results_file=results_path(out_dir, name),
                       n_selected=len(rows), n_run=len(todo), n_resumed=len(rows) - len(todo), results=results)
