"""The profile writer: sampled initial states, behaviours chosen by an LLM (or the rule table), one JSONL row each.

The plan is deterministic: `n` states drawn by a `StateController` from the given weights (uniform when none)
with `seed`. For each planned index the LLM is asked (`answers.profile_request`) up to `max_attempts` times;
an answer that `answers.check_answer` rejects, that repeats an already written profile, or a failed request is
kept in `<out>.rejected.jsonl` with its reason. When every attempt failed, or no endpoint is given, or the
endpoint failed `breaker` times in a row (it is then given up for the rest of the run), the behaviours are drawn
by the rule table (`RuleTable.sample`) instead. Scores always come from the plan.

Output rows `{"index", "source": "llm"|"rule", "attempts", "repairs", "profile"}` are appended as they finish,
so a killed run resumes (same settings, checked against `<out>.meta.json`) by writing only the missing indices;
a torn last line is dropped. Once complete the file is rewritten in index order. `<out>.stats.json` holds the
run's counts.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from llm_agent.controller import ControllerConfig, StateController
from llm_agent.openai_endpoint import EndpointError
from llm_agent.profiles.answers import check_answer, profile_request
from llm_agent.profiles.pool import profile_of_row
from llm_agent.profiles.rules import RuleTable
from llm_agent.profiles.sources import ChatEndpoint
from llm_agent.scenario import Scenario, UserProfile

logger = logging.getLogger(__name__)

__all__ = ["ProfileWriter", "WriterSettings", "profile_identity"]

RULE_CHECKS = ("repair", "off")
REJECTED_ANSWER_CHARS = 2000  # of a rejected answer's text kept in the rejected file


@dataclass
class WriterSettings:
    """What to write: `n` profiles from `seed`; behaviour counts; whether LLM answers are held to the rule table
    (`rule_check`: repair drops contradicting behaviours, off keeps the LLM's choice); retries and concurrency."""

    n: int
    seed: int = 0
    min_behaviors: int = 1
    max_behaviors: int = 3
    allow_extremes: bool = False
    rule_check: str = "repair"
    max_attempts: int = 3
    concurrency: int = 8
    breaker: int = 20

    def __post_init__(self) -> None:
        if self.n < 1 or self.max_attempts < 1 or self.concurrency < 1 or self.breaker < 1:
            raise ValueError(f"n, max_attempts, concurrency and breaker must be >= 1, got {self}")
        if not 0 <= self.min_behaviors <= self.max_behaviors:
            raise ValueError(f"need 0 <= min_behaviors <= max_behaviors, got {self.min_behaviors}, "
                             f"{self.max_behaviors}")
        if self.rule_check not in RULE_CHECKS:
            raise ValueError(f"rule_check must be one of {RULE_CHECKS}, got {self.rule_check!r}")


def profile_identity(profile: UserProfile) -> tuple[tuple[tuple[str, int], ...], frozenset[str]]:
    """What makes two profiles duplicates: the same state and the same set of behaviours."""
    return tuple(sorted(profile.state.items())), frozenset(b.behavior for b in profile.behaviors)


class ProfileWriter:
    """Writes `settings.n` profiles to `out_path` (see the module docstring); `run()` returns the counts."""

    def __init__(self, scenario: Scenario, out_path: str | os.PathLike, settings: WriterSettings,
                 rules: RuleTable, weights: dict[str, dict[str, float]] | None = None,
                 endpoint: ChatEndpoint | None = None) -> None:
        self.scenario, self.settings, self.rules, self.endpoint = scenario, settings, rules, endpoint
        rules.check_library(scenario.behaviors, f"scenario {scenario.name}", scenario.dims)
        self.out = Path(out_path)
        self.rejected_path = self.out.with_name(self.out.name + ".rejected.jsonl")
        self.meta_path = self.out.with_name(self.out.name + ".meta.json")
        self.stats_path = self.out.with_name(self.out.name + ".stats.json")
        config = ControllerConfig(joint=bool(weights) and "joint" in weights, allow_extremes=settings.allow_extremes,
                                  seed=settings.seed, min_behaviors=settings.min_behaviors,
                                  max_behaviors=settings.max_behaviors, profile_source="uniform")
        planner = StateController(config, scenario)
        if weights:
            planner.set_weights(weights)
        self.weights = planner.weights
        self.states = planner.sample_states(settings.n)
        self._lock = threading.Lock()
        self._seen: set[tuple[str, frozenset[str]]] = set()
        self._failures_in_row = 0
        self._llm_down = endpoint is None
        self.counts: Counter = Counter()

    # ------------------------------------------------------------------------------------------ resume
    def _meta(self) -> dict[str, Any]:
        plan = hashlib.sha256(json.dumps(self.states).encode()).hexdigest()[:16]
        return {"scenario": self.scenario.name, "settings": {k: v for k, v in asdict(self.settings).items()
                                                             if k not in ("concurrency", "max_attempts", "breaker")},
                "weights": self.weights, "plan": plan}

    def _check_meta(self) -> None:
        meta = self._meta()
        if self.meta_path.is_file() and self.out.is_file():
            saved = json.loads(self.meta_path.read_text(encoding="utf-8"))
            changed = sorted(k for k in meta if saved.get(k) != meta[k])
            if changed:
                raise ValueError(f"{self.out} was started with other {', '.join(changed)} ({self.meta_path}); "
                                 "use another output file or delete it to start over")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.meta_path.write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")

    def _read_done(self) -> dict[int, dict[str, Any]]:
        """Rows already written, by index; a torn last line (a kill mid-write) is cut off the file."""
        if not self.out.is_file():
            return {}
        raw = self.out.read_bytes()
        lines = raw.split(b"\n")
        if lines and lines[-1] != b"":  # no newline at the end: the last write was interrupted
            logger.warning("%s: dropping an incomplete last line (%d bytes)", self.out, len(lines[-1]))
            raw = raw[: len(raw) - len(lines[-1])]
            self.out.write_bytes(raw)
        done: dict[int, dict[str, Any]] = {}
        for lineno, line in enumerate(raw.decode("utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                index, profile = row["index"], profile_of_row(row)
                if not isinstance(index, int) or not 0 <= index < self.settings.n or index in done:
                    raise ValueError(f"index {index!r} is not a new index in [0, {self.settings.n})")
                planned = self.scenario.state_schema.state(self.states[index])
                if profile.state != planned:
                    raise ValueError(f"state {self.scenario.state_key(profile.state)} is not the planned "
                                     f"{self.scenario.state_key(planned)}")
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{self.out}:{lineno}: cannot resume from this row: {exc}") from None
            done[index] = row
            self._seen.add(profile_identity(profile))
        return done

    # ------------------------------------------------------------------------------------------ one index
    def _count(self, key: str) -> None:
        with self._lock:
            self.counts[key] += 1

    def _reject(self, rejected: list[dict[str, Any]], index: int, attempt: int, reason: str,
                answer: str | None = None, **extra: Any) -> None:
        """Keep one rejected answer with its reason; the answer's text is kept up to `REJECTED_ANSWER_CHARS`
        characters (with its full length), so a flood of text cannot grow the rejected file."""
        kept = None if answer is None else answer[:REJECTED_ANSWER_CHARS]
        rejected.append({"index": index, "attempt": attempt, "state": self.scenario.state_key(self.states[index]),
                         "reason": reason, "answer": kept, **extra,
                         **({"answer_chars": len(answer)} if answer is not None and len(answer) > len(kept) else {})})
        self._count(f"rejected/{reason}")

    def _claim(self, profile: UserProfile) -> bool:
        """Reserve the profile's identity; False when an equal profile was already written or claimed."""
        identity = profile_identity(profile)
        with self._lock:
            if identity in self._seen:
                return False
            self._seen.add(identity)
            return True

    def _endpoint_result(self, ok: bool) -> None:
        with self._lock:
            self._failures_in_row = 0 if ok else self._failures_in_row + 1
            if self._failures_in_row >= self.settings.breaker and not self._llm_down:
                self._llm_down = True
                logger.warning("the profile LLM failed %d requests in a row: drawing the remaining profiles by "
                               "the rule table", self._failures_in_row)

    def _ask_llm(self, index: int, rejected: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, int]:
        s, state = self.settings, self.states[index]
        messages = profile_request(self.scenario, state, s.min_behaviors, s.max_behaviors)
        rules = self.rules if s.rule_check == "repair" else None
        attempt = 0
        while attempt < s.max_attempts and not self._llm_down:
            attempt += 1
            try:
                text = self.endpoint.complete(messages, seed=s.seed * 1_000_003 + index * 101 + attempt)
            except EndpointError as exc:
                self._endpoint_result(False)
                self._reject(rejected, index, attempt, f"endpoint_{exc.kind}", detail=str(exc), answer=None)
                time.sleep(min(0.1 * 2 ** attempt, 2.0))
                continue
            self._endpoint_result(True)
            check = check_answer(text, self.scenario.state_schema.state(state), self.scenario.behaviors,
                                 s.min_behaviors, s.max_behaviors, rules, self.scenario.state_ranges)
            if not check.accepted:
                self._reject(rejected, index, attempt, check.reject_reason, detail=check.detail,
                             repairs=check.repairs, answer=text)
            elif not self._claim(check.profile):
                self._reject(rejected, index, attempt, "duplicate", answer=text)
            else:
                self._count("llm/repaired" if check.repairs else "llm/clean")
                return {"index": index, "source": "llm", "attempts": attempt, "repairs": check.repairs,
                        "profile": check.profile.to_dict()}, attempt
        return None, attempt

    def _by_rules(self, index: int, attempts: int) -> dict[str, Any]:
        s, state = self.settings, self.states[index]
        profile = None
        for k in range(50):  # a fresh draw until it is not a duplicate (50 equal draws: keep the last)
            rng = random.Random(f"{s.seed}-{index}-{k}")
            behaviors = self.rules.sample(self.scenario.behaviors, state, self.scenario.state_ranges, rng,
                                          s.min_behaviors, s.max_behaviors)
            profile = self.scenario.profile(state, behaviors)
            if self._claim(profile):
                break
            self._count("rule/duplicate_redrawn")
        else:
            self._count("rule/duplicate_kept")
        return {"index": index, "source": "rule", "attempts": attempts, "repairs": [], "profile": profile.to_dict()}

    def _write_one(self, index: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        rejected: list[dict[str, Any]] = []
        row, attempts = (None, 0) if self._llm_down else self._ask_llm(index, rejected)
        if row is None:
            if self.endpoint is not None:
                self._count("fallback/" + ("endpoint_down" if attempts == 0 else "attempts_exhausted"))
            row = self._by_rules(index, attempts)
        return row, rejected

    # ------------------------------------------------------------------------------------------ the run
    def run(self) -> dict[str, Any]:
        """Write every missing index; return (and save to `<out>.stats.json`) the counts of this run."""
        self._check_meta()
        done = self._read_done()
        pending = [i for i in range(self.settings.n) if i not in done]
        logger.info("profile writer: %d of %d profiles already in %s, writing %d", len(done), self.settings.n,
                    self.out, len(pending))
        progress = tqdm(total=self.settings.n, initial=len(done), desc="profiles", unit="profile")
        with open(self.out, "a", encoding="utf-8") as out, open(self.rejected_path, "a", encoding="utf-8") as rej, \
                ThreadPoolExecutor(max_workers=self.settings.concurrency) as pool:
            futures = [pool.submit(self._write_one, i) for i in pending]
            for future in as_completed(futures):
                row, rejected = future.result()
                for item in rejected:
                    rej.write(json.dumps(item) + "\n")
                rej.flush()
                out.write(json.dumps(row) + "\n")
                out.flush()
                done[row["index"]] = row
                progress.update(1)
        progress.close()
        ordered = [done[i] for i in range(self.settings.n)]
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in ordered), encoding="utf-8")
        os.replace(tmp, self.out)
        return self._stats(ordered, len(pending))

    def _stats(self, rows: list[dict[str, Any]], written: int) -> dict[str, Any]:
        violating = Counter(r["source"] for r in rows
                            if self.rules.violations(profile_of_row(r), self.scenario.state_ranges))
        stats = {"out": str(self.out), "requested": self.settings.n, "written_now": written,
                 "already_written": self.settings.n - written,
                 "by_source": dict(Counter(r["source"] for r in rows)),
                 "rows_violating_rules": dict(violating), "this_run": dict(sorted(self.counts.items())),
                 "rejected_answers_file": str(self.rejected_path)}
        self.stats_path.write_text(json.dumps(stats, indent=1) + "\n", encoding="utf-8")
        logger.info("profile writer: %s", stats)
        return stats
