"""The SEAD rollout loop: multi-turn dialogues between the policy (the service agent) and a user simulator.

`LLMGenerationManager` is the trainer's `rollout_loop.path` plug-in (a `verl.trainer.ppo.plugins.RolloutLoop`;
configs name it `llm_agent.generation.LLMGenerationManager`) and generates through a `RolloutEngine`. Per
generation batch it gives every row a simulated user (`UserProfiles`), makes one environment per row (its kind from
the row's `env_class` column, else `rollout_loop.config.env`; `llm_agent.envs`) and runs them to their outcomes
with the sync scheduler (below: all active dialogues per turn) or the async one (`async_loop.py`: each
dialogue at its own pace); the schedulers only schedule, so both modes give the same dialogues. Every dialogue is
returned as one row: the generation tensors plus its `DialogueRecord` in `non_tensor_batch["dialogue"]` (see
docs/rollout_loop.md). The trainer hooks update the state controller, guard the simulator error rate, write the
rollout and validation logs and checkpoint the controller and the user-response cache.
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

from tqdm import tqdm

from llm_agent.cache import UserResponseCache
from llm_agent.controller import StateController
from llm_agent.diagnosis import annotate_record, diagnosis_metrics
from llm_agent.envs import (ENV_COLUMN, AgentBatches, ChatMarkers, EnvContext, Environment, RequestSeeds, TokenBuffer,
                            env_class)
from llm_agent.metrics import dialogue_metrics
from llm_agent.rollout.async_loop import run_dialogues_async
from llm_agent.rollout.config import ROOT_KEY, ConfigError, GenerationConfig
from llm_agent.rollout.dialogue_record import DIALOGUE_KEY, DialogueRecord, records_from_batch
from llm_agent.rollout.judges import judge_metrics, judge_split
from llm_agent.rollout.outcome import Outcome
from llm_agent.rollout.pacing import BusyMeter, pacing_metrics
from llm_agent.rollout.records import append_jsonl, log_lines, object_column, prefixed
from llm_agent.rollout.step_outcomes import StepOutcomes
from llm_agent.rollout.user_profiles import UserProfiles
from llm_agent.scenario import load_scenario
from llm_agent.user_sim.client import SimulatorCheckError, SimulatorClient, TurnRequest, UserSimClient
from verl.protocol import DataProto
from verl.trainer.ppo.plugins import BatchOutputs, ConsoleMetric, RolloutLoop
from verl.workers.rollout.engine import RolloutEngine

logger = logging.getLogger(__name__)

__all__ = ["CACHE_SNAPSHOT", "LLMGenerationManager"]

CACHE_SNAPSHOT = "user_response_cache.jsonl"  # the cache's replies, in a checkpoint's rollout_loop/ directory


class RolloutSetup(NamedTuple):
    """One rollout call before its dialogues run: its number, environments, token buffer and agent-turn batcher."""

    call: int
    envs: list[Environment]
    buffer: TokenBuffer
    batches: AgentBatches


class LLMGenerationManager(RolloutLoop):
    """Runs SEAD dialogues for a generation batch; see the module docstring.

    `client` may inject any `SimulatorClient` (tests, benchmarks, evaluation); without it a `UserSimClient` is
    built from `rollout_loop.config.user_sim` and owned (closed by `close()`). Validation loops
    (`is_validation=True`) use no cache and no controller and read every row's profile from the dataset's
    `user_profile` column. A validation loop with `judges` also runs every batch against each judge
    (`llm_agent/rollout/judges.py`).
    """

    # Completion rate and outcome mix first, then the generation vs simulator time split.
    console_metrics: ClassVar[Sequence[ConsoleMetric]] = (
        ("dialogue/completion_rate", "CR%"),
        (("dialogue/completion_rate", "dialogue/hang_up_rate", "dialogue/agent_ended_rate",
          "dialogue/timeout_rate", "dialogue/truncated_rate", "dialogue/error_rate"), "done/hang/quit/time/trunc/err%"),
        ("val/dialogue/completion_rate", "val CR%"),
        ("rollout/time_generate_s", "gen_s"), ("rollout/time_user_sim_s", "sim_s"),
    )

    @classmethod
    def batch_outputs(cls, config: Mapping[str, Any]) -> BatchOutputs:
        """Neither per-turn rewards nor failure labels: the dialogue reward (llm_agent.reward) writes those."""
        return BatchOutputs()

    def __init__(self, tokenizer: Any, engine: RolloutEngine, config: Mapping[str, Any], is_validation: bool,
                 client: SimulatorClient | None = None) -> None:
        super().__init__(tokenizer, engine, config, is_validation)
        self.config = GenerationConfig.from_dict(config)
        self.scenario = load_scenario(self.config.scenario)
        try:
            self.env_class = env_class(self.config.env)
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"{ROOT_KEY}.env: {exc.args[0]}") from None
        self.eos_id = tokenizer.eos_token_id
        if self.eos_id is None:
            raise ValueError("the tokenizer has no eos_token_id; the rollout loop needs one to end agent turns")
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self.markers = ChatMarkers.from_tokenizer(tokenizer, self.eos_id)
        tags = self.scenario.agent_tags
        reply_tag = tags.tag("reply")
        self.format_error_message = self.config.format_error_message or (
            f"(The customer heard nothing: your last message had no <{reply_tag}>...</{reply_tag}> block. "
            "Answer again in the required format.)")
        self.range_error_message = self.config.format_error_message or (
            f"(The customer heard nothing: <{tags.tag('stage')}> must be one of "
            f"{', '.join(map(str, self.scenario.stage_ids))} and <{tags.tag('status')}> one of "
            f"{', '.join(map(str, sorted(self.scenario.statuses.values)))}. Answer again in the required format.)")
        self._owns_client = client is None
        self.client: SimulatorClient | None = client if client is not None else self._build_client()
        use_cache = not self.is_validation and self.config.cache.enabled
        self.cache = UserResponseCache(self.config.cache, self.scenario.name, self.scenario.state_schema) \
            if use_cache else None
        use_controller = not self.is_validation and self.config.controller.enabled
        self.controller = StateController(self.config.controller, self.scenario) if use_controller else None
        self.profiles = UserProfiles(self.scenario, self.controller, self.is_validation)
        self.step_outcomes = StepOutcomes(self.config.user_sim)
        self.calls = 0  # run_llm_loop calls so far (checkpointed: training simulator seeds depend on it)
        self.judge_clients: dict[str, UserSimClient] = {}
        try:
            for name, urls in (self.config.judges if self.is_validation else {}).items():
                self.judge_clients[name] = self._build_client(urls, f"judge {name!r}")
        except BaseException:
            self.close()
            raise
        self.judged: dict[str, list[DialogueRecord]] = {name: [] for name in self.judge_clients}  # until validation end
        logger.info("rollout loop (%s): scenario %r, max_turns=%d, per-turn %d / per-trajectory %d tokens, "
                    "cache %s, controller %s", "validation" if self.is_validation else "training",
                    self.scenario.name, self.config.max_turns, self.config.max_tokens_per_turn,
                    self.config.max_response_length, "on" if self.cache is not None else "off",
                    "on" if self.controller is not None else "off")

    def _build_client(self, urls: list[str] | None = None, what: str = "user simulators") -> UserSimClient:
        """A client of `urls` (default: `user_sim.urls`) with the `user_sim` settings, its instances checked."""
        sim = self.config.user_sim
        urls = urls or sim.urls
        if not urls:
            raise ConfigError(f"{ROOT_KEY}.user_sim.urls is required (the simulator instances' base URLs)")
        client = UserSimClient(urls, model=sim.model, api_key=sim.api_key, timeout_s=sim.timeout_s,
                               max_attempts=sim.max_attempts, deadline_s=sim.deadline_s)
        if sim.check_at_start:
            try:
                served = client.check_instances()
            except SimulatorCheckError as exc:
                client.close()
                raise SimulatorCheckError(f"{what}: {exc}. Start the simulators (scripts/start_user_sims.sh) or fix "
                                          f"{ROOT_KEY}.user_sim.urls / .judges / .user_sim.model") from None
            logger.info("%s ready: %s", what, served)
        return client

    # ------------------------------------------------------------------------------------------ the loop
    def run_llm_loop(self, gen_batch: DataProto) -> DataProto:
        """Run every row's dialogue to an outcome; returns the generation tensors and per-dialogue records."""
        call = self._count_call(gen_batch)
        records, buffer, engines, sim, pacing, wall = self._dialogues(self._setup(gen_batch, call), self.client)
        if not self.is_validation and gen_batch.meta_info.get("do_sample", True):  # not a greedy ReMax baseline
            self.step_outcomes.add(records)
        for name, client in self.judge_clients.items():  # the same prompts, profiles and seeds, another simulator
            judged, judged_buffer, _, _, _, judged_wall = self._dialogues(self._setup(gen_batch, call), client)
            self._finish_records(judged, judged_buffer, judged_wall)
            self.judged[name].extend(judged)
        return self._output(call, records, buffer, engines, sim, pacing, wall)

    def start_llm_loop(self, gen_batch: DataProto) -> Callable[[], DataProto]:
        """A training rollout started now (the call counted, every row's user drawn from the controller, the
        simulator seeds fixed, in the order of the calls) and run by the returned callable, from any thread, beside
        other rollouts started so; its dialogues are counted for the controller by the end-of-step hook, from the
        batch it gets."""
        if self.is_validation:
            raise RuntimeError("start_llm_loop runs training rollouts; validation runs run_llm_loop")
        setup = self._setup(gen_batch, self._count_call(gen_batch))

        def run() -> DataProto:
            return self._output(setup.call, *self._dialogues(setup, self.client))
        return run

    def _count_call(self, gen_batch: DataProto) -> int:
        """Check the generation batch's inputs and count the call; returns its number (the simulator seeds depend
        on it)."""
        for key in ("input_ids", "attention_mask"):
            if gen_batch.batch is None or key not in gen_batch.batch.keys():
                raise ValueError(f"run_llm_loop needs gen_batch.batch[{key!r}] (left-padded agent prompts)")
        if "uid" not in gen_batch.non_tensor_batch:
            raise ValueError("run_llm_loop needs non_tensor_batch['uid'] (the trainer's prompt ids)")
        self.calls += 1
        return self.calls

    def _setup(self, gen_batch: DataProto, call: int) -> RolloutSetup:
        """Call `call`'s environments (one per row, reset with its user), their token buffer and agent-turn batcher."""
        buffer = TokenBuffer(gen_batch.batch["input_ids"], gen_batch.batch["attention_mask"],
                             self.config.max_response_length, self.pad_id)
        envs = self._envs(gen_batch, buffer, call)
        meta = {k: v for k, v in gen_batch.meta_info.items() if k != "metrics"}
        return RolloutSetup(call, envs, buffer,
                            AgentBatches(buffer, meta, self.eos_id, self.pad_id, self.config.max_tokens_per_turn))

    def _dialogues(self, setup: RolloutSetup, client: SimulatorClient
                   ) -> tuple[list[DialogueRecord], TokenBuffer, list[BusyMeter], BusyMeter, dict[str, float], float]:
        """Run every dialogue of `setup` with `client`'s simulators: the records, the token buffer, the engines'
        and the simulator's busy meters, the pacing metrics and the wall time."""
        envs, buffer, batches = setup.envs, setup.buffer, setup.batches
        started = time.monotonic()
        try:
            if self.config.mode == "async":
                engines, sim = run_dialogues_async(envs, self.engine, batches, client, self.config.async_rollout)
            else:
                engines, sim = run_turn_synchronous(envs, self.engine, batches, client, self.config.max_turns)
            wall = time.monotonic() - started
        finally:  # also when a call fails: no consecutive-hit flag may outlive its dialogue
            if self.cache is not None:
                for env in envs:
                    self.cache.end_dialogue(env.dialogue_id)
                self.cache.sync()  # what the call stored is in the file when it returns
        for env in envs:
            if env.active:
                raise RuntimeError(f"dialogue {env.dialogue_id} has no outcome after {self.config.max_turns} turns")
        records = [env.record() for env in envs]
        pacing = pacing_metrics(wall, engines, sim, [env.ended_at - started for env in envs])
        return records, buffer, engines, sim, pacing, wall

    def _envs(self, gen_batch: DataProto, buffer: TokenBuffer, call: int) -> list[Environment]:
        """One environment per row (its kind: the row's `env_class`, else `rollout_loop.config.env`), reset with the
        row's user; dialogue ids `<uid>#<k>` (k-th row of the uid)."""
        uids = [str(u) for u in gen_batch.non_tensor_batch["uid"]]
        profiles = self.profiles.for_rows(gen_batch, uids)
        kinds = self._env_classes(gen_batch.non_tensor_batch.get(ENV_COLUMN), uids)
        context = EnvContext(
            scenario=self.scenario, tokenizer=self.tokenizer, markers=self.markers, eos_id=self.eos_id,
            max_turns=self.config.max_turns, max_user_tokens=self.config.max_user_tokens,
            user_sim=self.config.user_sim, format_error_message=self.format_error_message,
            range_error_message=self.range_error_message, cache=self.cache,
            seeds=RequestSeeds(self.config.seed, call, self.is_validation))
        seen: dict[str, int] = {}
        envs = []
        for row, (uid, profile, kind) in enumerate(zip(uids, profiles, kinds)):
            k = seen.get(uid, 0)
            seen[uid] = k + 1
            env = kind(context, buffer, row, uid, f"{uid}#{k}")
            env.reset(profile)
            envs.append(env)
        return envs

    def _env_classes(self, column: Any, uids: list[str]) -> list[type[Environment]]:
        """Each row's environment class: its `env_class` cell when the dataset has one, else the run's kind."""
        if column is None:
            return [self.env_class] * len(uids)
        out = []
        for i, name in enumerate(column):
            try:
                out.append(env_class(str(name)) if name else self.env_class)
            except (KeyError, TypeError) as exc:
                raise ValueError(f"non_tensor_batch[{ENV_COLUMN!r}][{i}] (uid {uids[i]!r}): {exc.args[0]}") from None
        return out

    def _finish_records(self, records: list[DialogueRecord], buffer: TokenBuffer, wall: float) -> dict[str, Any]:
        """Each record's cost and diagnosis (an error row gets its own uid); returns the buffer's final tensors."""
        tensors = buffer.final_tensors()
        # what each dialogue cost: its sampled (loss-carrying) tokens and its share of the call's wall time
        for record, tokens in zip(records, tensors["response_mask"].sum(dim=1).tolist()):
            record.agent_tokens, record.wall_s = int(tokens), wall / len(records)
        for i, record in enumerate(records):  # per-turn signals and failure labels (llm_agent/diagnosis)
            annotate_record(record, self.scenario, record.dialogue_id)
            # an error row (no loss) is its own GRPO group, so it does not shift its siblings' baseline
            if record.outcome == Outcome.ERROR:
                record.uid = f"{record.uid}/error/{record.dialogue_id}"
        return tensors

    def _output(self, call: int, records: list[DialogueRecord], buffer: TokenBuffer, engines: list[BusyMeter],
                sim: BusyMeter, pacing: dict[str, float], wall: float) -> DataProto:
        tensors = self._finish_records(records, buffer, wall)
        columns = {"uid": object_column([r.uid for r in records]), DIALOGUE_KEY: object_column(records)}
        metrics = prefixed(dialogue_metrics(records, self.scenario), "rollout/")
        generate_s = sum(m.busy_s for m in engines)
        metrics.update({"rollout/sim_requests": float(sim.started), "rollout/time_generate_s": generate_s,
                        "rollout/time_user_sim_s": sim.busy_s, **pacing})
        outcomes = {o: sum(r.outcome == o for r in records) for o in {r.outcome for r in records}}
        logger.info("rollout %d (%s, %s): %d dialogues in %.1fs, outcomes %s, %.1fs generating, %.1fs waiting for "
                    "the simulator", call, "val" if self.is_validation else "train", self.config.mode,
                    len(records), pacing["rollout/time_to_last_dialogue_s"], dict(sorted(outcomes.items())),
                    generate_s, sim.busy_s)
        return DataProto.from_dict(tensors=tensors, non_tensors=columns, meta_info={"metrics": metrics})

    # --------------------------------------------------------------------------------------- trainer hooks
    def on_train_step_end(self, batch: DataProto, step: int) -> dict[str, float]:
        """After a training step: update the controller from every non-error dialogue sampled in the step (also
        those dynamic sampling left out of `batch`, so its completion rates are not biased toward mixed groups),
        append the rollout log, and return dialogue (`dialogue/`, over the trained `batch`), failure-label counts
        (`diagnosis/labels/*`), cache (`cache/`), controller (`controller/`) and client (`user_sim/`) metrics."""
        records = records_from_batch(batch)
        metrics = prefixed(dialogue_metrics(records, self.scenario), "dialogue/")
        metrics.update(diagnosis_metrics(records, self.scenario))
        if not self.step_outcomes.counted:  # rollouts started by start_llm_loop: the batch holds the step's dialogues
            self.step_outcomes.add(records)
        completions = self.step_outcomes.take_completions()
        metrics.update(self.step_outcomes.check_error_rate(step))
        if self.controller is not None:
            metrics.update(prefixed(self.controller.update(completions), "controller/"))
        if self.cache is not None:
            metrics.update(prefixed(self.cache.metrics(reset=True), "cache/"))
        metrics.update(self._client_stats(self.client))
        if self.config.rollout_log_path:
            append_jsonl(self.config.rollout_log_path, log_lines(records, step, "train"))
        return metrics

    def on_validation_end(self, batches: Sequence[DataProto], step: int) -> dict[str, float]:
        """After validation: metrics over all validation dialogues (`dialogue/`, `diagnosis/labels/*`) and the
        validation client's (`user_sim/`; the trainer adds `val/`), one `{"step", "n_dialogues", "metrics"}` line
        appended to `val_metrics_path`, rollout-log lines (split val). With judges also each judge's metrics
        (`<judge>/...`, its client's under `<judge>/user_sim/`) and the exploitation gaps (`judge_metrics`), the
        line's `judges` ({name: {"n_dialogues", "metrics"}}) and `exploitation_gap`, and the judges' dialogues
        (split `val@<judge>`)."""
        records = [r for batch in batches for r in records_from_batch(batch)]
        raw = dialogue_metrics(records, self.scenario)
        metrics = {**prefixed(raw, "dialogue/"), **diagnosis_metrics(records, self.scenario),
                   **self._client_stats(self.client)}
        line: dict[str, Any] = {"step": step, "n_dialogues": len(records), "metrics": raw}
        lines = log_lines(records, step, "val")
        if self.judge_clients:
            judged = {name: self.judged[name] for name in self.judge_clients}
            self.judged = {name: [] for name in self.judge_clients}
            gaps = judge_metrics(records, judged, self.scenario)
            metrics.update(gaps)
            line["judges"] = {name: {"n_dialogues": len(judged[name]),
                                     "metrics": dialogue_metrics(judged[name], self.scenario)} for name in judged}
            line["exploitation_gap"] = gaps.get("exploitation_gap")
            for name, client in self.judge_clients.items():
                metrics.update(self._client_stats(client, name))
                lines += log_lines(judged[name], step, judge_split(name))
        if self.config.val_metrics_path:
            append_jsonl(self.config.val_metrics_path, [json.dumps(line)])
        if self.config.rollout_log_path:
            append_jsonl(self.config.rollout_log_path, lines)
        return metrics

    @staticmethod
    def _client_stats(client: SimulatorClient, judge: str | None = None) -> dict[str, float]:
        """A simulator client's counters since the last call (`user_sim/`, a judge's `<judge>/user_sim/`), then
        reset."""
        stats = prefixed(client.stats(), "user_sim/")
        client.reset_stats()
        return stats if judge is None else {f"{judge}/{key}": value for key, value in stats.items()}

    def state_dict(self) -> dict[str, Any]:
        """What the trainer checkpoints: the controller's and the cache's state (None without them; the cached
        replies themselves are in the cache file) and the loop's call count."""
        return {"controller": None if self.controller is None else self.controller.state_dict(),
                "cache": None if self.cache is None else self.cache.state_dict(), "calls": self.calls}

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
        self.calls = int(state["calls"])

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

    def close(self) -> None:
        """Close the simulator client this loop built (an injected one is left to its owner) and flush the cache."""
        if self._owns_client and self.client is not None:
            self.client.close()
            self.client = None
        for client in self.judge_clients.values():
            client.close()
        self.judge_clients = {}
        if self.cache is not None:
            self.cache.flush()


def run_turn_synchronous(envs: Sequence[Environment], engine: RolloutEngine, batches: AgentBatches,
                         client: SimulatorClient, max_turns: int) -> tuple[list[BusyMeter], BusyMeter]:
    """Run every dialogue to its outcome, one turn of all active dialogues at a time; returns the engine's and the
    simulator's busy meters."""
    busy, sim = BusyMeter(), BusyMeter()
    for _ in tqdm(range(max_turns), desc="dialogue turns", leave=False):
        active = [env for env in envs if env.active]
        if not active:
            break
        call = batches([env.row for env in active], engine.world_size)
        busy.begin(len(active))
        try:
            turns = call.run(engine)
        finally:
            busy.end(len(active))
        pending: list[tuple[Environment, TurnRequest]] = []
        for env, turn in zip(active, turns):
            step = env.step(turn)
            if step.request is not None:
                pending.append((env, step.request))
        while pending:
            pending = _simulator_round(pending, client, sim)
    return [busy], sim


def _simulator_round(pending: list[tuple[Environment, TurnRequest]], client: SimulatorClient,
                     sim: BusyMeter) -> list[tuple[Environment, TurnRequest]]:
    """Send every pending request in one batch and hand each answer to its dialogue; returns the re-requests."""
    requests = [request for _, request in pending]
    sim.begin(len(requests))
    try:
        results = client.complete(requests)
    finally:
        sim.end(len(requests))
    if len(results) != len(requests):
        raise RuntimeError(f"the simulator client answered {len(results)} of {len(requests)} requests")
    again = []
    for (env, _), result in zip(pending, results):
        step = env.answer(result)
        if step.request is not None:
            again.append((env, step.request))
    return again
