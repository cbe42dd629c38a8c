"""Calls where a person plays the user: the rollout loop with a simulator client whose replies a person writes.

`HumanCall` runs one dialogue through `LLMGenerationManager` in validation mode (the same prompt, tokens, limits,
environment, reward and record as an evaluation) on its own thread. The loop's simulator is `HumanUserClient`:
each `TurnRequest` waits until the person answers (`HumanCall.answer`: their words, the state they report and
whether they end the call), formatted in the scenario's user tag protocol. Beside each request it keeps what the
scripted persona and, when one is configured, a simulator would have answered to the same request. An engine
that streams text (`TextStreaming`: a local HF model, an OpenAI-compatible endpoint) hands the agent's turn over
in pieces as it is written (`partial`, for the page, at most `MAX_PARTIAL_CHARS`; the turn and record are the
loop's as without it). A finished call
is one evaluation record (the rollout-log line of `log_lines`, split `eval`, the person's turns with
`user_source: "human"`, with `judge: "human"` and those answers per person turn in `previews`) appended to
`<out>/human_dialogues.jsonl`; `python -m for_evaluation.simulator_report --dialogues` grades the previews
against the person's turns.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llm_agent.generation import LLMGenerationManager
from llm_agent.metrics import dialogue_metrics
from llm_agent.reward import compute_reward
from llm_agent.rollout.dialogue_record import HUMAN_USER_SOURCE, DialogueRecord, records_from_batch
from llm_agent.rollout.records import append_jsonl, log_lines, object_column
from llm_agent.scenario import Scenario, UserProfile
from llm_agent.simulator_report.human import HUMAN_JUDGE, PREVIEW_SOURCES
from llm_agent.user_sim.client import SimulatorClient, TurnFailure, TurnReply, TurnRequest, TurnResult
from llm_agent.user_sim.server.backend import BackendInputError, SamplingParams
from llm_agent.user_sim.server.scripted import ScriptedPersonaBackend
from verl.workers.rollout.engine import TextStreaming

logger = logging.getLogger(__name__)

__all__ = ["HUMAN_FILE", "HUMAN_JUDGE", "HumanCall", "HumanUserClient", "PersonTurn", "mark_person_turns",
           "persona_card", "scenario_prompt_file"]

HUMAN_FILE = "human_dialogues.jsonl"
INSTANCE = "human"
SPLIT = "eval"
END_CHOICES = {None: "ongoing", "agreed": "completed", "hung_up": "ended"}  # the page's choice -> status name
MAX_REPLY_CHARS = 2000
MAX_PARTIAL_CHARS = 32_000  # what the page is shown of an agent turn being written (far more than a turn's tokens)
PREVIEWS = PREVIEW_SOURCES  # the answers to the same request shown beside the person's


@dataclass(frozen=True)
class PersonTurn:
    """What the person answered: their words, the state they report and how the call goes on (`END_CHOICES`)."""

    reply: str
    state: dict[str, int]
    end: str | None = None


def persona_card(scenario: Scenario, profile: UserProfile) -> dict[str, Any]:
    """What the page shows of the user to play: initial state, behaviours, the doubts to voice and the persona."""
    doubts = []
    for b in profile.behaviors:
        script = scenario.scripted.categories.get(b.category)
        doubts.append({"category": b.category, "lines": list(script.doubt) if script else []})
    return {"state": dict(profile.state), "behaviors": [b.to_dict() for b in profile.behaviors], "doubts": doubts,
            "persona": scenario.render_user_prompt(profile)}


def scenario_prompt_file(scenario: Scenario, path: Path) -> Path:
    """A one-row prompt parquet of the scenario's own agent prompt (the `prompt` column of
    utils/create_prompt_data.py, when no prompt file is known; each call brings its own profile)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([{"prompt": scenario.render_agent_messages([]),
                                          "data_source": scenario.name}]), path)
    return path


def _check_turn(scenario: Scenario, turn: PersonTurn) -> str:
    """The person's turn in the user tag protocol; ValueError saying what is wrong with it."""
    reply = turn.reply.strip() if isinstance(turn.reply, str) else ""
    if not reply:
        raise ValueError("the reply is empty")
    if len(reply) > MAX_REPLY_CHARS:
        raise ValueError(f"the reply has {len(reply)} characters, more than {MAX_REPLY_CHARS}")
    if turn.end not in END_CHOICES:
        raise ValueError(f"end must be one of {sorted(k for k in END_CHOICES if k)} or null, got {turn.end!r}")
    state = turn.state if isinstance(turn.state, Mapping) else {}
    if set(state) != set(scenario.dims):
        raise ValueError(f"the state must give exactly {list(scenario.dims)}")
    for dim, value in state.items():
        rng = scenario.state_ranges[dim]
        if isinstance(value, bool) or not isinstance(value, int) or not rng.contains(value):
            raise ValueError(f"state {dim} must be an integer in [{rng.min}, {rng.max}], got {value!r}")
    status = getattr(scenario.statuses, END_CHOICES[turn.end])
    text = scenario.format_user_output(reply, state, status)
    parsed = scenario.parse_user_output(text)
    if not parsed.well_formed or parsed.reply != reply or parsed.status != status:
        raise ValueError("the reply holds text of the protocol's tags; reword it")
    return text


def mark_person_turns(records: Sequence[DialogueRecord]) -> None:
    """Set `user_source` to "human" on the user turns a person wrote (the loop records them as a simulator's)."""
    for record in records:
        for turn in record.turns:
            if turn.user_source == "simulator":
                turn.user_source = HUMAN_USER_SOURCE


class HumanUserClient(SimulatorClient):
    """A simulator client whose answers a person writes (module docstring); one dialogue at a time."""

    def __init__(self, scenario: Scenario, on_request: Any, seed: int = 0, timeout_s: float = 3600.0,
                 simulator: SimulatorClient | None = None) -> None:
        self.scenario, self.on_request, self.timeout_s = scenario, on_request, timeout_s
        self.persona = ScriptedPersonaBackend(scenario, seed=seed)
        self.simulator = simulator
        self.answers: queue.Queue[PersonTurn | None] = queue.Queue()

    def _parsed(self, text: str) -> dict[str, Any]:
        turn = self.scenario.parse_user_output(text)
        return {"reply": turn.reply, "state": turn.state, "status": turn.status, "format_valid": turn.well_formed}

    def simulator_answer(self, request: TurnRequest) -> dict[str, Any] | None:
        """What the configured simulator answers to `request` (None without one; {"error"} when it failed)."""
        if self.simulator is None:
            return None
        try:
            result = self.simulator.complete([request])[0]
        except Exception as exc:  # a preview must never end the call
            logger.warning("the simulator preview failed: %s", exc)
            return {"error": f"{type(exc).__name__}: {exc}"}
        if isinstance(result, TurnFailure):
            return {"error": result.reason}
        return self._parsed(result.text)

    def scripted_answer(self, request: TurnRequest) -> dict[str, Any] | None:
        """What the scripted persona answers to `request` (reply, state, status), None when it refuses it."""
        params = SamplingParams(n=1, temperature=request.temperature, top_p=request.top_p, seed=request.seed,
                                max_tokens=request.max_tokens)
        try:
            text = self.persona.complete(request.messages, params).choices[0].text
        except BackendInputError as exc:
            logger.warning("the scripted persona refused the request: %s", exc)
            return None
        return self._parsed(text)

    def complete(self, requests: Sequence[TurnRequest]) -> list[TurnResult]:
        """Each request's answer from the person (in order), a TurnFailure when the call was abandoned."""
        return [self._ask(request) for request in requests]

    def _ask(self, request: TurnRequest) -> TurnResult:
        started = time.monotonic()
        self.on_request(request, {"scripted": self.scripted_answer(request),
                                  "simulator": self.simulator_answer(request)})
        try:
            turn = self.answers.get(timeout=self.timeout_s)
        except queue.Empty:
            turn = None
        if turn is None:
            return TurnFailure(request.dialogue_id, "the person left the call", 1, ["abandoned"])
        text = _check_turn(self.scenario, turn)
        return TurnReply(request.dialogue_id, text, INSTANCE, time.monotonic() - started, 1)

    def abandon(self) -> None:
        """End a waiting (or the next) request without an answer."""
        self.answers.put(None)


class HumanCall:
    """One call: the loop on its own thread, what the page shows (`snapshot`) and the record at the end."""

    def __init__(self, agent: Any, tokenizer: Any, scenario: Scenario, loop_config: Mapping[str, Any],
                 prompt_batch: Any, profile: UserProfile, out_dir: str | Path, step: int = 0,
                 extra: Mapping[str, Any] | None = None, seed: int = 0,
                 simulator: SimulatorClient | None = None, stream: bool = True) -> None:
        scenario.check_profile(profile)
        self.scenario, self.tokenizer, self.profile = scenario, tokenizer, profile
        self.out_file = Path(out_dir) / HUMAN_FILE
        self.step, self.extra = step, dict(extra or {})
        self.uid = f"human-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}"
        self.changed = threading.Condition()
        self.phase, self.turns, self.pending, self.result, self.error = "agent", [], None, None, None
        self.version = 0
        self.agent_turns = 0  # agent turns the person was asked to answer so far
        self.abandoned = False
        self.agent = agent
        self.streams = stream and isinstance(agent, TextStreaming)  # an engine that hands out its text as it comes
        self.fresh = True  # the next piece of text starts a generation
        self.partial: str | None = "" if self.streams else None  # the agent turn so far, while it is generated
        self.client = HumanUserClient(scenario, self._on_request, seed=seed, simulator=simulator)
        self.loop = LLMGenerationManager(tokenizer, agent, loop_config, is_validation=True, client=self.client)
        batch = prompt_batch
        batch.non_tensor_batch["uid"] = object_column([self.uid])
        batch.non_tensor_batch["user_profile"] = object_column([json.dumps(profile.to_dict())])
        batch.meta_info = {"do_sample": False, "validate": True}
        self.thread = threading.Thread(target=self._run, args=(batch,), name=f"call-{self.uid}", daemon=True)
        self.thread.start()

    def _set(self, **changes: Any) -> None:
        with self.changed:
            for key, value in changes.items():
                setattr(self, key, value)
            self.version += 1
            self.changed.notify_all()

    def _on_request(self, request: TurnRequest, previews: dict[str, Any]) -> None:
        self._set(phase="user", pending={"agent": request.messages[-1]["content"], **previews},
                  partial=None, agent_turns=self.agent_turns + 1)

    def _on_text(self, piece: str | None) -> None:
        """One more piece of the agent's turn (None: the generation, or an attempt at it, ended)."""
        if piece is None:  # the next generation starts afresh; `partial` keeps this one's text until then
            self.fresh = True
            return
        with self.changed:
            text = "" if self.fresh else (self.partial or "")
            self.fresh = False
            if len(text) >= MAX_PARTIAL_CHARS:
                return
            self.partial = text + piece[:MAX_PARTIAL_CHARS - len(text)]
            self.version += 1
            self.changed.notify_all()

    def _run(self, batch: Any) -> None:
        if self.streams:
            self.agent.stream_text(self._on_text)
        try:
            out = self.loop.run_llm_loop(batch)
            if self.abandoned:
                self._set(phase="abandoned", pending=None)
                return
            compute_reward(out, self.tokenizer, scenario=self.loop.config.scenario)
            records = records_from_batch(out)
            mark_person_turns(records)
            previews = [{k: t[k] for k in PREVIEWS} for t in self.turns]
            lines = [json.dumps({**json.loads(line), **self.extra, "judge": HUMAN_JUDGE, "previews": previews},
                                ensure_ascii=False) for line in log_lines(records, self.step, SPLIT)]
            append_jsonl(self.out_file, lines)
            record = records[0]
            metrics = dialogue_metrics(records, self.scenario)
            self._set(phase="done", pending=None, result={
                "dialogue_id": record.dialogue_id, "outcome": record.outcome, "turns": record.num_turns,
                "completion_rate": metrics.get("completion_rate"), "file": str(self.out_file),
                "last_agent": record.turns[-1].agent_reply if record.turns else None})
        except Exception as exc:  # the page shows it; the server keeps serving
            logger.exception("call %s failed", self.uid)
            self._set(phase="error", pending=None, error=f"{type(exc).__name__}: {exc}")
        finally:
            if self.streams:
                self.agent.stream_text(None)
            self.loop.close()

    def answer(self, turn: PersonTurn) -> None:
        """Hand the person's turn to the waiting request; ValueError when none waits or the turn is invalid."""
        _check_turn(self.scenario, turn)
        with self.changed:
            if self.phase != "user":
                raise ValueError(f"the call is not waiting for your turn (it is {self.phase})")
            agent = self.pending["agent"] if self.pending else None
            previews = {k: (self.pending or {}).get(k) for k in PREVIEWS}
            self.turns.append({"agent": agent, "user": turn.reply.strip(), "state": dict(turn.state),
                               "end": turn.end, **previews})
            self.phase, self.pending = "agent", None
            self.fresh, self.partial = True, "" if self.streams else None
            self.version += 1
            self.changed.notify_all()
        self.client.answers.put(turn)

    def abandon(self) -> None:
        """Stop the call without writing a record."""
        self.abandoned = True
        self.client.abandon()

    def wait(self, since: int, timeout_s: float) -> None:
        """Until the call moved past version `since` and no longer waits on the agent, or `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while self.version <= since or self.phase == "agent":
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.changed.wait(left)

    def progress(self, since: int, timeout_s: float) -> dict[str, Any]:
        """After the call moved past version `since` (or `timeout_s`): its version, phase, agent turns answered so
        far and the agent's turn being generated (`partial`, None when the engine does not stream it)."""
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while self.version <= since and (left := deadline - time.monotonic()) > 0:
                self.changed.wait(left)
            return {"version": self.version, "phase": self.phase, "agent_turns": self.agent_turns,
                    "partial": self.partial}

    def snapshot(self) -> dict[str, Any]:
        """What the page shows: the persona card, the turns so far, the agent turn waiting and the result."""
        with self.changed:
            return {"id": self.uid, "phase": self.phase, "version": self.version,
                    "card": persona_card(self.scenario, self.profile), "turns": list(self.turns),
                    "pending": self.pending, "result": self.result, "error": self.error, "partial": self.partial,
                    "streams": self.streams}
