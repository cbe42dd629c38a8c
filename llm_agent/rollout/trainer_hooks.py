"""The rollout loop's trainer-facing side: the step and validation hooks, the error-rate guard, and what a
checkpoint keeps of the loop (controller, cache RNG and replies, call count). Mixed into
`llm_agent.generation.LLMGenerationManager`, whose attributes it uses."""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from llm_agent.metrics import dialogue_metrics, records_from_batch
from llm_agent.rollout.config import ROOT_KEY
from llm_agent.rollout.records import RECORD_COLUMNS, append_jsonl, log_lines, prefixed
from verl.protocol import DataProto

logger = logging.getLogger(__name__)

__all__ = ["CACHE_SNAPSHOT", "TrainerHooksMixin"]

CACHE_SNAPSHOT = "user_response_cache.jsonl"  # the cache's replies, in a checkpoint's rollout_loop/ directory


class TrainerHooksMixin:
    """`on_train_step_end`, `on_validation_end`, `state_dict` / `load_state_dict` and `save_checkpoint` /
    `load_checkpoint` of the rollout loop (see docs/architecture.md, "Plug-ins by dotted path")."""

    config: Any
    scenario: Any
    client: Any
    cache: Any
    controller: Any
    _calls: int
    _step_outcomes: list[tuple[str, bool]]
    _step_errors: list[str]
    _step_dialogues: int
    _error_steps: int

    def on_train_step_end(self, batch: DataProto, step: int) -> dict[str, float]:
        """After a training step: update the controller from every non-error dialogue sampled in the step (also
        those dynamic sampling left out of `batch`, so its completion rates are not biased toward mixed groups),
        append the rollout log, and return dialogue (`dialogue/`, over the trained `batch`), cache (`cache/`),
        controller (`controller/`) and client (`user_sim/`) metrics."""
        records = records_from_batch(batch, RECORD_COLUMNS)
        metrics = prefixed(dialogue_metrics(records, self.scenario), "dialogue/")
        outcomes = self._step_outcomes or [(r["state_key"], r["outcome"] == "completed") for r in records
                                           if r["outcome"] != "error"]
        self._step_outcomes = []
        metrics.update(self._check_error_rate(step))
        if self.controller is not None:
            metrics.update(prefixed(self.controller.update(outcomes), "controller/"))
        if self.cache is not None:
            metrics.update(prefixed(self.cache.metrics(reset=True), "cache/"))
        if hasattr(self.client, "stats"):
            metrics.update(prefixed(self.client.stats(), "user_sim/"))
            if hasattr(self.client, "reset_stats"):
                self.client.reset_stats()
        if self.config.rollout_log_path:
            append_jsonl(self.config.rollout_log_path, log_lines(records, step, "train"))
        return metrics

    def _check_error_rate(self, step: int) -> dict[str, float]:
        """The step's simulator-error rate over every sampled dialogue; raises when it has stayed above
        `user_sim.max_error_rate` for `user_sim.error_patience` steps in a row."""
        sim = self.config.user_sim
        total, errors = self._step_dialogues, self._step_errors
        self._step_dialogues, self._step_errors = 0, []
        rate = len(errors) / total if total else 0.0
        self._error_steps = self._error_steps + 1 if rate > sim.max_error_rate else 0
        if self._error_steps >= sim.error_patience:
            raise RuntimeError(
                f"stopping at step {step}: {rate:.0%} of the step's {total} dialogues ended in a user-simulator "
                f"error, above {ROOT_KEY}.user_sim.max_error_rate={sim.max_error_rate} for {self._error_steps} "
                f"steps in a row (error_patience={sim.error_patience}); e.g. {errors[0]!r}")
        return {"user_sim/step_error_rate": rate, "user_sim/error_steps_in_a_row": float(self._error_steps)}

    def on_validation_end(self, batches: Sequence[DataProto], step: int) -> dict[str, float]:
        """After validation: metrics over all validation dialogues (`dialogue/`) and the validation client's
        (`user_sim/`; the trainer adds `val/`), one `{"step", "n_dialogues", "metrics"}` line appended to
        `val_metrics_path`, rollout-log lines (split val)."""
        records = [r for batch in batches for r in records_from_batch(batch, RECORD_COLUMNS)]
        raw = dialogue_metrics(records, self.scenario)
        client_stats = prefixed(self.client.stats(), "user_sim/") if hasattr(self.client, "stats") else {}
        if hasattr(self.client, "reset_stats"):
            self.client.reset_stats()
        if self.config.val_metrics_path:
            line = json.dumps({"step": step, "n_dialogues": len(records), "metrics": raw})
            append_jsonl(self.config.val_metrics_path, [line])
        if self.config.rollout_log_path:
            append_jsonl(self.config.rollout_log_path, log_lines(records, step, "val"))
        return {**prefixed(raw, "dialogue/"), **client_stats}

    def state_dict(self) -> dict[str, Any]:
        """What the trainer checkpoints: the controller's and the cache's state (None without them; the cached
        replies themselves are in the cache file) and the loop's call count."""
        return {"controller": None if self.controller is None else self.controller.state_dict(),
                "cache": None if self.cache is None else self.cache.state_dict(), "calls": self._calls}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`; ValueError when it holds a controller state this loop has no controller for."""
        if not isinstance(state, Mapping) or "calls" not in state:
            raise ValueError(f"rollout-loop state must be a mapping with 'controller' and 'calls', got {state!r}")
        if state.get("controller") is not None:
            if self.controller is None:
                raise ValueError("the checkpoint holds a controller state but this loop has no controller "
                                 f"({ROOT_KEY}.controller.enabled=false or validation)")
            self.controller.load_state_dict(state["controller"])
        if state.get("cache") is not None and self.cache is not None:  # a cache turned off since is fine
            self.cache.load_state_dict(state["cache"])
        self._calls = int(state["calls"])

    def save_checkpoint(self, directory: str | os.PathLike) -> None:
        """Write into a checkpoint's `directory` what `state_dict()` does not hold: the cache's replies."""
        if self.cache is not None:
            count = self.cache.save_snapshot(Path(directory) / CACHE_SNAPSHOT)
            logger.info("cache snapshot: %d replies in %s", count, directory)

    def load_checkpoint(self, directory: str | os.PathLike) -> None:
        """Restore the cache's replies to exactly those of the checkpoint (replies added after it, still in the
        live cache file, are dropped), so a resumed run draws as an uninterrupted one."""
        if self.cache is None:
            return
        path = Path(directory) / CACHE_SNAPSHOT
        if path.is_file():
            self.cache.restore_snapshot(path)
        else:
            logger.warning("checkpoint directory %s has no cache snapshot (%s): the cache keeps the replies of its "
                           "live file, which may hold replies added after that checkpoint", directory, CACHE_SNAPSHOT)
