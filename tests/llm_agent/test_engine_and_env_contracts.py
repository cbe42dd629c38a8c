"""The rollout-engine contract and the environment registry, pinned: every engine the project ships is a
RolloutEngine and reports the policy version with each generation; environment kinds are classes registered by
name, chosen per run (`rollout_loop.config.env`) and per row (the dataset's `env_class` column), and a class that
breaks the contract is refused when it is built or registered, naming what is missing."""
from __future__ import annotations

import inspect
import time

import numpy as np
import pytest

from llm_agent.envs import (ENV_COLUMN, DialogueEnv, Environment, Step, env_class, register_env,
                            registered_envs)
from llm_agent.evaluation.agents import OpenAIChatAgent
from llm_agent.evaluation.local_agents import HFRolloutAgent, VLLMRolloutAgent
from llm_agent.generation import LLMGenerationManager
from llm_agent.rollout.dialogue_record import DialogueRecord, TurnRecord, records_from_batch
from llm_agent.rollout.outcome import Outcome
from llm_agent.stand_ins.scripted_policy import ScriptedPolicyWorkerGroup
from verl.protocol import DataProto
from verl.trainer.config_schema import ConfigError
from verl.workers.rollout.engine import RolloutEngine, TextStreaming
from verl.workers.rollout.hf_rollout import HFRollout
from verl.workers.rollout.replicas import RankGroupReplica, WorkerGroupEngine
from verl.workers.rollout.vllm_rollout import vLLMRollout

from tests.helpers.gen_loop_helpers import (ProgrammedPolicy, ProgrammedSim, agent_text, column, make_gen_batch)
from tests.helpers.repo import SCENARIO_PATH

ENGINE_METHODS = {"generate_sequences": ["prompts"], "replicas": [], "sleep": [], "wake_up": [], "close": [],
                  "versioned": ["output"]}


def _params(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


def test_the_rollout_engine_contract_is_pinned():
    public = {n for n, v in vars(RolloutEngine).items() if callable(v) and not n.startswith("_")}
    assert public == set(ENGINE_METHODS) and RolloutEngine.__abstractmethods__ == {"generate_sequences"}
    for name, params in ENGINE_METHODS.items():
        assert _params(getattr(RolloutEngine, name)) == params, name
    assert RolloutEngine.world_size == 1 and RolloutEngine.policy_version == 0


@pytest.mark.parametrize("engine", [HFRollout, vLLMRollout, WorkerGroupEngine, RankGroupReplica, OpenAIChatAgent,
                                    HFRolloutAgent, VLLMRolloutAgent, ScriptedPolicyWorkerGroup, ProgrammedPolicy])
def test_every_engine_is_a_rollout_engine(engine):
    assert issubclass(engine, RolloutEngine) and not inspect.isabstract(engine)
    assert _params(engine.generate_sequences) == _params(RolloutEngine.generate_sequences)


def test_text_streaming_is_a_contract_of_its_own():
    """Streaming an agent's turn as text (the chat page) is a capability a caller checks with isinstance, never a
    probe: a local HF model and an OpenAI-compatible endpoint have it, vLLM and the scripted agent do not."""
    assert TextStreaming.__abstractmethods__ == {"stream_text"}
    assert _params(TextStreaming.stream_text) == ["listener"]
    assert inspect.signature(TextStreaming.stream_text).parameters["listener"].annotation == \
        "Callable[[str | None], None] | None"
    assert issubclass(HFRolloutAgent, TextStreaming) and issubclass(OpenAIChatAgent, TextStreaming)
    for engine in (VLLMRolloutAgent, ScriptedPolicyWorkerGroup, HFRollout):
        assert not issubclass(engine, TextStreaming), engine


def test_an_engine_without_generate_sequences_fails_when_built():
    class Incomplete(RolloutEngine):
        def replicas(self):
            return [self]

    with pytest.raises(TypeError, match="abstract method.*generate_sequences"):
        Incomplete()


def test_the_policy_version_of_each_generation_reaches_its_turns(tok, scenario):
    """The version an engine reports with a generation is recorded on the agent turns it sampled; an engine that
    reports none fails the rollout, naming it."""
    policy = ProgrammedPolicy(tok, {"a": [agent_text(scenario, "Hello.")] * 2, "b": [agent_text(scenario, "Hi.")] * 2})
    policy.policy_version = 5
    config = {"scenario": str(SCENARIO_PATH), "max_turns": 2, "max_response_length": 512,
              "cache": {"enabled": False}, "controller": {"enabled": False}}
    sim = ProgrammedSim(scenario, {"a": [("Who?", 0)] * 2, "b": [("Who?", 0)] * 2})
    out = LLMGenerationManager(tok, policy, config, is_validation=True, client=sim).run_llm_loop(
        make_gen_batch(tok, scenario, ["a", "b"]))
    assert [t.policy_version for r in records_from_batch(out) for t in r.turns] == [5] * 4

    class Unversioned(ProgrammedPolicy):
        def generate_sequences(self, data: DataProto) -> DataProto:
            out = super().generate_sequences(data)
            out.meta_info.pop("policy_version")
            return out

    loop = LLMGenerationManager(tok, Unversioned(tok, {"a": [agent_text(scenario, "Hello.")]}), config,
                                is_validation=True, client=sim)
    with pytest.raises(RuntimeError, match=r"Unversioned.generate_sequences returned meta_info\['policy_version'\]"):
        loop.run_llm_loop(make_gen_batch(tok, scenario, ["a"]))


# ---------------------------------------------------------------------------------------- environments
ENV_METHODS = {"reset": ["profile"], "step": ["turn"], "answer": ["result"], "record": []}


class OneTurnEnv(Environment):
    """An environment kind of its own (not a dialogue): the agent's first turn ends the episode, no simulator."""

    def reset(self, profile) -> None:
        self.profile, self.turns = profile, []

    @property
    def active(self) -> bool:
        return not self.turns

    def step(self, turn) -> Step:
        self.buffer.append_sampled(self.row, turn.ids, 0, turn.log_probs)
        text = self.context.tokenizer.decode(turn.ids.tolist(), skip_special_tokens=True)
        self.turns.append(TurnRecord(agent_text=text, policy_version=turn.policy_version))
        self.ended_at = time.monotonic()
        return Step(self.turns[-1], outcome=Outcome.AGENT_ENDED)

    def answer(self, result) -> Step:
        raise RuntimeError("OneTurnEnv makes no simulator request")

    def record(self) -> DialogueRecord:
        scenario = self.context.scenario
        return DialogueRecord(self.dialogue_id, Outcome.AGENT_ENDED.value, self.turns, uid=self.uid,
                              profile=self.profile.to_dict(), state_key=scenario.state_key(self.profile.state))


def test_the_environment_contract_is_pinned():
    assert Environment.__abstractmethods__ == {"reset", "active", "step", "answer", "record"}
    for name, params in ENV_METHODS.items():
        assert _params(getattr(Environment, name)) == params, name
    assert _params(Environment.__init__) == ["context", "buffer", "row", "uid", "dialogue_id"]
    assert issubclass(DialogueEnv, Environment) and env_class("dialogue") is DialogueEnv
    assert "dialogue" in registered_envs()


def test_registration_refuses_what_breaks_the_contract():
    class NoAnswer(Environment):
        reset = step = record = OneTurnEnv.reset
        active = OneTurnEnv.active

    with pytest.raises(TypeError, match=r"environment 'no_answer': NoAnswer does not implement \['answer'\]"):
        register_env("no_answer", NoAnswer)
    with pytest.raises(TypeError, match="not a subclass of llm_agent.envs.Environment"):
        register_env("not_an_env", dict)
    with pytest.raises(KeyError, match=r"unknown environment 'nope'; registered: \[.*'dialogue'"):
        env_class("nope")
    with pytest.raises(KeyError, match="cannot import"):
        env_class("tests.nowhere.Env")
    register_env("contract_one_turn", OneTurnEnv)
    with pytest.raises(ValueError, match="already registered"):
        register_env("contract_one_turn", DialogueEnv)
    assert env_class(f"{__name__}.OneTurnEnv") is OneTurnEnv  # a class path names a kind too


def test_env_kinds_are_chosen_per_run_and_per_row(tok, scenario):
    register_env("contract_one_turn", OneTurnEnv)
    scripts = {k: [agent_text(scenario, f"Hello from {k}.")] * 3 for k in "abc"}
    sim = ProgrammedSim(scenario, {k: [("Who?", 0)] * 3 for k in "abc"})
    base = {"scenario": str(SCENARIO_PATH), "max_turns": 3, "max_response_length": 512, "cache": {"enabled": False},
            "controller": {"enabled": False}}

    def run(config, kinds=None):
        batch = make_gen_batch(tok, scenario, list("abc"))
        if kinds is not None:
            batch.non_tensor_batch[ENV_COLUMN] = np.array(kinds, dtype=object)
        loop = LLMGenerationManager(tok, ProgrammedPolicy(tok, scripts), config, is_validation=True, client=sim)
        return loop.run_llm_loop(batch)

    per_run = run({**base, "env": "contract_one_turn"})
    assert column(per_run, "outcome") == ["agent_ended"] * 3 and column(per_run, "num_turns") == [1] * 3
    per_row = run(base, kinds=["contract_one_turn", "", "dialogue"])  # "" or None: the run's kind
    assert column(per_row, "num_turns") == [1, 3, 3] and column(per_row, "outcome")[0] == "agent_ended"
    assert per_row.batch["response_mask"][0].sum() > 0 and sim.calls_for("a") == 0
    with pytest.raises(ConfigError, match="rollout_loop.config.env: unknown environment 'nope'"):
        LLMGenerationManager(tok, ProgrammedPolicy(tok, scripts), {**base, "env": "nope"}, is_validation=True,
                             client=sim)
    with pytest.raises(ValueError, match=r"env_class'\]\[1\] \(uid 'b'\): unknown environment 'nope'"):
        run(base, kinds=["dialogue", "nope", "dialogue"])


def test_no_engine_or_environment_is_probed_for_what_it_has():
    """Callers call the contracts' methods; `getattr`/`hasattr` stay for third-party feature detection only."""
    import re

    from tests.helpers.repo import REPO

    probe = re.compile(r"(getattr|hasattr)\(\s*(self\.)?(engine|policy|agent|env|envs?\[[^]]*\]|worker_group|wg|"
                       r"replica|group)\s*,")
    found = [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
             for package in ("llm_agent", "verl", "for_evaluation", "bench") for path in (REPO / package).rglob("*.py")
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if probe.search(line)]
    assert found == []
