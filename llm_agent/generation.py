"""The SEAD rollout loop: multi-turn dialogues between the policy (the service agent) and a user simulator.

`LLMGenerationManager` is the trainer's `rollout_loop.path` plug-in. In `sync` mode each turn it left-pads the
active dialogues' contexts into one batch, calls `actor_rollout_wg.generate_sequences`, and then asks the
simulator for all their user turns in one `complete_batch` call; in `async` mode (llm_agent/rollout/async_loop.py)
every dialogue runs as its own task and its turns are batched with whatever other dialogues are waiting at that
moment. The rules of a turn are the same in both (llm_agent/rollout/turns.py): the loop appends exactly the
sampled token ids (loss mask 1), parses the agent's tags, and answers the turn from the user-response cache
(training only; the cached words only, the dialogue keeps its own user state) or from the simulator (malformed
replies re-requested up to `user_sim.reply_retries` times). User turns are appended as the chat
template's role markers around the spoken reply (loss mask 0). An agent that claims the task done (status 1)
is heard: the call completes only if the user confirms, otherwise it ends as a false claim (`agent_ended`).
Every dialogue ends with one outcome (`completed`, `hung_up`, `agent_ended`, `timeout`, `truncated`, `error`)
and is returned as one row: the generation tensors plus the per-dialogue record in `non_tensor_batch` (see
docs/rollout_loop.md).
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm import tqdm

from llm_agent.cache import UserResponseCache
from llm_agent.controller import StateController
from llm_agent.metrics import dialogue_metrics
from llm_agent.rollout.async_loop import run_dialogues_async
from llm_agent.rollout.config import ROOT_KEY, ConfigError, GenerationConfig
from llm_agent.rollout.dialogue import ChatMarkers, Dialogue, TokenBuffer
from llm_agent.rollout.pacing import BusyMeter, pacing_metrics
from llm_agent.rollout.records import RECORD_COLUMNS, object_column, prefixed
from llm_agent.rollout.trainer_hooks import CACHE_SNAPSHOT, TrainerHooksMixin
from llm_agent.rollout.turns import DialogueTurnsMixin
from llm_agent.scenario import AgentTurn, UserProfile, load_scenario
from llm_agent.user_sim.client import SimulatorCheckError, UserSimClient
from verl.protocol import DataProto

logger = logging.getLogger(__name__)

__all__ = ["CACHE_SNAPSHOT", "LLMGenerationManager"]


def _profile_from_row(value: Any, row: int, uid: str) -> UserProfile:
    """Parse the dataset's `user_profile` cell (JSON string or mapping); ValueError naming the row."""
    where = f"non_tensor_batch['user_profile'][{row}] (uid {uid!r})"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc})") from None
    if value is None:
        raise ValueError(f"{where} is missing")
    try:
        return UserProfile.from_dict(value)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


class LLMGenerationManager(DialogueTurnsMixin, TrainerHooksMixin):
    """Runs SEAD dialogues for a generation batch; see the module docstring.

    `client` may inject any object with `complete_batch(list[ChatRequest]) -> list[ChatReply | TurnFailure]`
    (tests, benchmarks); without it a `UserSimClient` is built from `rollout_loop.config.user_sim` and owned
    (closed by `close()`). Validation loops (`is_validation=True`) use no cache and no controller and read every
    row's profile from the dataset's `user_profile` column.
    """

    # What the trainer's per-step console line shows first for dialogue runs (metric, label).
    console_metrics = (
        ("dialogue/completion_rate", "CR%"),
        (("dialogue/completion_rate", "dialogue/hang_up_rate", "dialogue/agent_ended_rate",
          "dialogue/timeout_rate", "dialogue/truncated_rate", "dialogue/error_rate"), "done/hang/quit/time/trunc/err%"),
        ("val/dialogue/completion_rate", "val CR%"),
        ("rollout/time_generate_s", "gen_s"), ("rollout/time_user_sim_s", "sim_s"),
    )

    def __init__(self, tokenizer: Any, actor_rollout_wg: Any, config: Mapping[str, Any], is_validation: bool,
                 client: Any = None) -> None:
        self.config = GenerationConfig.from_dict(config)
        self.scenario = load_scenario(self.config.scenario)
        self.tokenizer, self.wg, self.is_validation = tokenizer, actor_rollout_wg, bool(is_validation)
        self.eos_id = tokenizer.eos_token_id
        if self.eos_id is None:
            raise ValueError("the tokenizer has no eos_token_id; the rollout loop needs one to end agent turns")
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self.markers = ChatMarkers.from_tokenizer(tokenizer, self.eos_id)
        reply_tag = self.scenario.agent_tags.tag("reply")
        self.format_error_message = self.config.format_error_message or (
            f"(The customer heard nothing: your last message had no <{reply_tag}>...</{reply_tag}> block. "
            "Answer again in the required format.)")
        tags = self.scenario.agent_tags
        self.range_error_message = self.config.format_error_message or (
            f"(The customer heard nothing: <{tags.tag('stage')}> must be one of "
            f"{', '.join(map(str, self.scenario.stage_ids))} and <{tags.tag('status')}> one of -1, 0, 1. "
            "Answer again in the required format.)")
        self._owns_client = client is None
        self.client = client if client is not None else self._build_client()
        use_cache = not self.is_validation and self.config.cache.enabled
        ranges = {d: (r.min, r.max) for d, r in self.scenario.state_ranges.items()}
        self.cache = UserResponseCache(self.config.cache, self.scenario.name, ranges) if use_cache else None
        use_controller = not self.is_validation and self.config.controller.enabled
        self.controller = StateController(self.config.controller, self.scenario) if use_controller else None
        self._calls = 0
        self._group_profiles: dict[str, UserProfile] = {}  # uid -> profile, previous call only
        self._step_outcomes: list[tuple[str, bool]] = []  # (state key, completed) of this step's sampled dialogues
        self._step_errors: list[str] = []  # error reasons of this step's sampled dialogues
        self._step_dialogues = 0
        self._error_steps = 0  # consecutive steps above user_sim.max_error_rate
        logger.info("rollout loop (%s): scenario %r, max_turns=%d, per-turn %d / per-trajectory %d tokens, "
                    "cache %s, controller %s", "validation" if self.is_validation else "training",
                    self.scenario.name, self.config.max_turns, self.config.max_tokens_per_turn,
                    self.config.max_response_length, "on" if self.cache is not None else "off",
                    "on" if self.controller is not None else "off")

    def _build_client(self) -> UserSimClient:
        sim = self.config.user_sim
        if not sim.urls:
            raise ConfigError(f"{ROOT_KEY}.user_sim.urls is required (the simulator instances' base URLs)")
        client = UserSimClient(sim.urls, model=sim.model, api_key=sim.api_key, timeout_s=sim.timeout_s,
                               max_attempts=sim.max_attempts, deadline_s=sim.deadline_s)
        if sim.check_at_start:
            try:
                served = client.check_instances()
            except SimulatorCheckError as exc:
                client.close()
                raise SimulatorCheckError(f"{exc}. Start the simulators (scripts/start_user_sims.sh) or fix "
                                          f"{ROOT_KEY}.user_sim.urls / .model") from None
            logger.info("user simulators ready: %s", served)
        return client

    # ------------------------------------------------------------------------------------------ set-up
    def _profiles(self, gen_batch: DataProto, uids: Sequence[str]) -> list[UserProfile]:
        """One profile per row: per uid group from the controller, else from the `user_profile` column.

        A uid group that the previous call also ran keeps its profile: the trainer's ReMax baseline rolls the same
        prompts out twice in one step (greedy, then sampled), and both must talk to the same simulated user.
        """
        if self.controller is not None:
            starts = [i for i in range(len(uids)) if i == 0 or uids[i] != uids[i - 1]]
            group_uids = [uids[i] for i in starts]
            if len(set(group_uids)) != len(group_uids):
                raise ValueError("rows of one uid must be consecutive (repeat with interleave=True) so that each "
                                 "GRPO group shares one sampled profile")
            fresh = iter(self.controller.sample(sum(u not in self._group_profiles for u in group_uids)))
            self._group_profiles = {u: self._group_profiles[u] if u in self._group_profiles else next(fresh)
                                    for u in group_uids}
            return [self._group_profiles[u] for u in uids]
        column = gen_batch.non_tensor_batch.get("user_profile")
        if column is None:
            mode = "validation" if self.is_validation else f"training with {ROOT_KEY}.controller.enabled=false"
            raise ValueError(f"{mode} needs the dataset column 'user_profile' (a JSON profile per row)")
        profiles = [_profile_from_row(column[i], i, uids[i]) for i in range(len(uids))]
        for i, profile in enumerate(profiles):
            try:
                self.scenario.check_profile(profile)
            except ValueError as exc:
                raise ValueError(f"non_tensor_batch['user_profile'][{i}] (uid {uids[i]!r}): {exc}") from None
        return profiles

    def _dialogues(self, gen_batch: DataProto) -> list[Dialogue]:
        if "uid" not in gen_batch.non_tensor_batch:
            raise ValueError("run_llm_loop needs non_tensor_batch['uid'] (the trainer's prompt ids)")
        uids = [str(u) for u in gen_batch.non_tensor_batch["uid"]]
        profiles = self._profiles(gen_batch, uids)
        seen: dict[str, int] = {}
        dialogues = []
        for row, (uid, profile) in enumerate(zip(uids, profiles)):
            k = seen.get(uid, 0)
            seen[uid] = k + 1
            persona = {"role": "system", "content": self.scenario.render_user_prompt(profile)}
            dialogues.append(Dialogue(row=row, uid=uid, dialogue_id=f"{uid}#{k}", profile=profile,
                                      sim_messages=[persona]))
        return dialogues

    # ------------------------------------------------------------------------------------------ the loop
    def run_llm_loop(self, gen_batch: DataProto) -> DataProto:
        """Run every row's dialogue to an outcome; returns the generation tensors and per-dialogue records."""
        self._calls += 1
        for key in ("input_ids", "attention_mask"):
            if gen_batch.batch is None or key not in gen_batch.batch.keys():
                raise ValueError(f"run_llm_loop needs gen_batch.batch[{key!r}] (left-padded agent prompts)")
        dialogues = self._dialogues(gen_batch)
        buffer = TokenBuffer(gen_batch.batch["input_ids"], gen_batch.batch["attention_mask"],
                             self.config.max_response_length, self.pad_id)
        meta = {k: v for k, v in gen_batch.meta_info.items() if k != "metrics"}
        started = time.monotonic()
        try:
            if self.config.mode == "async":
                engines, sim = run_dialogues_async(self, dialogues, buffer, meta)
            else:
                engines, sim = [BusyMeter()], BusyMeter()
                self._run_sync(dialogues, buffer, meta, engines[0], sim)
            wall = time.monotonic() - started
        finally:  # also when a call fails: no consecutive-hit flag may outlive its dialogue
            if self.cache is not None:
                for d in dialogues:
                    self.cache.end_dialogue(d.dialogue_id)
        for d in dialogues:
            if d.active:
                raise RuntimeError(f"dialogue {d.dialogue_id} has no outcome after {d.num_turns} turns")
        if not self.is_validation and gen_batch.meta_info.get("do_sample", True):  # not a greedy ReMax baseline
            self._step_outcomes += [(d.profile.state_key, d.outcome == "completed") for d in dialogues
                                    if d.outcome != "error"]
            self._step_errors += [d.error or "error" for d in dialogues if d.outcome == "error"]
            self._step_dialogues += len(dialogues)
        pacing = pacing_metrics(wall, engines, sim, [d.ended_at - started for d in dialogues])
        return self._output(dialogues, buffer, engines, sim, pacing)

    def _run_sync(self, dialogues: list[Dialogue], buffer: TokenBuffer, meta: dict[str, Any],
                  engine: BusyMeter, sim: BusyMeter) -> None:
        """Turn-synchronous: each turn, all active dialogues generate as one batch, then all wait for the
        simulator's answers to that turn."""
        for _ in tqdm(range(self.config.max_turns), desc="dialogue turns", leave=False):
            active = [d for d in dialogues if d.active]
            if not active:
                break
            pending = self._agent_turn(active, buffer, meta, engine)
            if pending:
                self._simulator_turn(pending, buffer, sim)

    def _agent_turn(self, active: list[Dialogue], buffer: TokenBuffer, meta: dict[str, Any],
                    engine: BusyMeter) -> list[tuple[Dialogue, AgentTurn]]:
        """Generate and record one agent turn per active dialogue; returns those waiting for the simulator."""
        for d in active:
            if buffer.remaining(d.row) < 1:
                d.end("truncated")
        active = [d for d in active if d.active]
        if not active:
            return []
        call = self._generation_call([d.row for d in active], buffer, meta, int(getattr(self.wg, "world_size", 1)))
        engine.begin(len(active))
        try:
            responses, lengths = call.run(self.wg.generate_sequences)
        finally:
            engine.end(len(active))
        kept = [self._keep_agent_tokens(d, responses[i, :lengths[i]], buffer) for i, d in enumerate(active)]
        texts = self.tokenizer.batch_decode([ids.tolist() for ids, _ in kept], skip_special_tokens=True)
        pending = []
        for d, text, (_, cut) in zip(active, texts, kept):
            turn = self._agent_output(d, text, cut, buffer)
            if turn is not None:
                pending.append((d, turn))
        return pending

    def _simulator_turn(self, pending: list[tuple[Dialogue, AgentTurn]], buffer: TokenBuffer,
                        sim: BusyMeter) -> None:
        """Ask the simulator for every pending dialogue's user turn in one batch and apply the answers; malformed
        replies are re-requested together (new seed, any instance) up to `user_sim.reply_retries` times."""
        for attempt in range(self.config.user_sim.reply_retries + 1):
            requests = [self._sim_request(d, attempt) for d, _ in pending]
            sim.begin(len(requests))
            try:
                results = self.client.complete_batch(requests)
            finally:
                sim.end(len(requests))
            if len(results) != len(requests):
                raise RuntimeError(f"the simulator client answered {len(results)} of {len(requests)} requests")
            pending = [(d, agent) for (d, agent), result in zip(pending, results)
                       if self._take_reply(d, agent, result, attempt, buffer)]
            if not pending:
                return

    # ----------------------------------------------------------------------------------------- output
    def _output(self, dialogues: list[Dialogue], buffer: TokenBuffer, engines: list[BusyMeter], sim: BusyMeter,
                pacing: dict[str, float]) -> DataProto:
        errors = [d.row for d in dialogues if d.outcome == "error"]
        tensors = buffer.final_tensors(errors)
        records = [d.record() for d in dialogues]
        uids = [f"{d.uid}/error/{d.dialogue_id}" if d.outcome == "error" else d.uid for d in dialogues]
        columns = {"uid": object_column(uids)}
        columns.update({key: object_column([r[key] for r in records]) for key in RECORD_COLUMNS if key != "uid"})
        metrics = prefixed(dialogue_metrics(records, self.scenario), "rollout/")
        generate_s = sum(m.busy_s for m in engines)
        metrics.update({"rollout/sim_requests": float(sim.started), "rollout/time_generate_s": generate_s,
                        "rollout/time_user_sim_s": sim.busy_s, **pacing})
        outcomes = {o: sum(d.outcome == o for d in dialogues) for o in {d.outcome for d in dialogues}}
        logger.info("rollout %d (%s, %s): %d dialogues in %.1fs, outcomes %s, %.1fs generating, %.1fs waiting for "
                    "the simulator", self._calls, "val" if self.is_validation else "train", self.config.mode,
                    len(dialogues), pacing["rollout/time_to_last_dialogue_s"], dict(sorted(outcomes.items())),
                    generate_s, sim.busy_s)
        return DataProto.from_dict(tensors=tensors, non_tensors=columns, meta_info={"metrics": metrics})

    def close(self) -> None:
        """Close the simulator client this loop built (an injected one is left to its owner) and flush the cache."""
        if self._owns_client and self.client is not None:
            self.client.close()
            self.client = None
        if self.cache is not None:
            self.cache.flush()
