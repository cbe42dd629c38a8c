"""The dialogue side's contracts: the rollout loop and the reward are the engine's plug-ins, every simulator client
is a SimulatorClient, DialogueEnv's interface (driven here without a loop), one handler per outcome, and the
layout rules (no mixins, no reaching into the loop's private names, client and server share no code)."""
from __future__ import annotations

import ast
import asyncio
import inspect
from pathlib import Path

import pytest
import torch
from tests.helpers.gen_loop_helpers import ProgrammedSim, agent_text, make_gen_batch
from omegaconf import OmegaConf

from llm_agent.generation import LLMGenerationManager
from llm_agent.metrics import OUTCOMES
from llm_agent.envs import DialogueEnv, EnvContext, RequestSeeds, Step
from llm_agent.envs import ChatMarkers, TokenBuffer
from verl.workers.rollout.engine import SampledTurn
from llm_agent.rollout.outcome import Outcome
from llm_agent.stand_ins.inprocess_user_sim import InProcessUserSim
from llm_agent.user_sim.client import SimulatorClient, TurnFailure, TurnReply, TurnRequest, UserSimClient, UserSimConfig
from llm_agent.user_sim.server.chat_request import ChatRequest
from verl.trainer.ppo.plugins import RolloutLoop, bind_reward
from tests.helpers.profiles import profile3

REPO = Path(__file__).resolve().parents[2]
HOOKS = ("run_llm_loop", "state_dict", "load_state_dict", "on_train_step_end", "on_validation_end",
         "save_checkpoint", "load_checkpoint", "close")
CLIENT_METHODS = {"complete": ["requests"], "acomplete": ["request"], "run_on_loop": ["coroutine"], "stats": [],
                  "reset_stats": [], "close": []}


def _params(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


def test_the_rollout_loop_is_the_engines_plug_in():
    assert issubclass(LLMGenerationManager, RolloutLoop)
    assert _params(LLMGenerationManager.__init__)[:4] == _params(RolloutLoop.__init__)
    for name in HOOKS:
        assert name in vars(LLMGenerationManager), f"LLMGenerationManager does not implement {name}"
        assert _params(getattr(LLMGenerationManager, name)) == _params(getattr(RolloutLoop, name)), name
    assert LLMGenerationManager.console_metrics and all(len(entry) == 2 for entry in LLMGenerationManager.console_metrics)


def test_the_dialogue_reward_binds_with_the_trainer_kwargs(tok):
    from llm_agent.reward import compute_reward
    from verl.trainer.config_schema import compose_config

    config = compose_config(["actor_rollout_ref.model.path=/x"], config_name="sead_trainer")
    kwargs = OmegaConf.to_container(config.reward.kwargs, resolve=True)
    assert _params(compute_reward)[:2] == ["data", "tokenizer"]
    bind_reward(compute_reward, tok, kwargs, "llm_agent.reward.compute_reward")


def test_simulator_client_contract_is_pinned():
    for name, params in CLIENT_METHODS.items():
        assert _params(getattr(SimulatorClient, name)) == params, name
    assert inspect.iscoroutinefunction(SimulatorClient.acomplete)
    for impl in (UserSimClient, InProcessUserSim, ProgrammedSim):
        assert issubclass(impl, SimulatorClient), impl
        for name in CLIENT_METHODS:
            method = getattr(impl, name)
            assert _params(method)[:len(CLIENT_METHODS[name])] == CLIENT_METHODS[name], (impl, name)
            assert inspect.iscoroutinefunction(method) == (name == "acomplete"), (impl, name)


def test_a_client_writing_only_complete_gets_working_defaults(scenario):
    class Echo(SimulatorClient):
        def complete(self, requests):
            return [TurnReply(r.dialogue_id, r.messages[-1]["content"], "echo", 0.0, 1) for r in requests]

    client = Echo()
    request = TurnRequest("d#0", [{"role": "system", "content": "persona"}, {"role": "user", "content": "hi"}])
    assert isinstance(client, SimulatorClient)
    assert client.run_on_loop(client.acomplete(request)).text == "hi"
    assert client.stats() == {} and client.reset_stats() is None and client.close() is None
    agent = scenario.parse_agent_output(agent_text(scenario, "Hello, this is Mia."))
    with InProcessUserSim(scenario) as sim:
        answer = sim.run_on_loop(sim.acomplete(TurnRequest(
            "d#0", scenario.render_user_messages(profile3(2, 2, 2), [agent]), seed=1)))
        assert isinstance(answer, TurnReply) and scenario.parse_user_output(answer.text).well_formed


def test_client_and_server_request_types_are_distinct():
    assert TurnRequest is not ChatRequest
    assert {f for f in TurnRequest.__dataclass_fields__} != {f for f in ChatRequest.__dataclass_fields__}


def _imports(package: Path) -> set[str]:
    names = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
    return names


def test_client_and_server_packages_share_no_code():
    user_sim = REPO / "llm_agent/user_sim"
    assert not any(m.startswith("llm_agent.user_sim.server") for m in _imports(user_sim / "client"))
    assert not any(m.startswith("llm_agent.user_sim.client") for m in _imports(user_sim / "server"))


def test_no_mixins_and_no_reaching_into_the_loop():
    for path in (REPO / "llm_agent").rglob("*.py"):
        text = path.read_text()
        assert "manager._" not in text, path
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                assert not node.name.endswith("Mixin"), f"{path}: class {node.name}"


def test_each_outcome_has_one_handler():
    assert tuple(o.value for o in Outcome) == OUTCOMES
    source = inspect.getsource(DialogueEnv)
    for outcome in Outcome:
        assert source.count(f"self._end(Outcome.{outcome.name}") == 1, outcome


# ------------------------------------------------------------------------------------ DialogueEnv on its own
def _env(tok, scenario, max_turns=3, budget=600) -> tuple[DialogueEnv, TokenBuffer]:
    batch = make_gen_batch(tok, scenario, ["x"])
    buffer = TokenBuffer(batch.batch["input_ids"], batch.batch["attention_mask"], budget, tok.pad_token_id)
    rules = EnvContext(scenario=scenario, tokenizer=tok, markers=ChatMarkers.from_tokenizer(tok, tok.eos_token_id),
                          eos_id=tok.eos_token_id, max_turns=max_turns, max_user_tokens=64,
                          user_sim=UserSimConfig(reply_retries=1), format_error_message="(format)",
                          range_error_message="(range)", cache=None, seeds=RequestSeeds(0, 1, True))
    env = DialogueEnv(rules, buffer, 0, "x", "x#0")
    env.reset(profile3(2, 2, 2))
    return env, buffer


def _ids(tok, text: str) -> SampledTurn:
    return SampledTurn(torch.tensor(tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]), None, 7)


def test_env_steps_a_dialogue_without_a_loop(tok, scenario):
    env, buffer = _env(tok, scenario)
    step = env.step(_ids(tok, agent_text(scenario, "Hello.")))
    assert isinstance(step, Step) and step.outcome is None and step.user_ids is None
    assert step.request.dialogue_id == "x#0" and step.request.messages[-1] == {"role": "user", "content": "Hello."}
    with pytest.raises(RuntimeError, match="waits for the simulator"):
        env.step(_ids(tok, "again"))
    retry = env.answer(TurnReply("x#0", "no reply tag", "fake", 0.0, 1))  # malformed: asked again, new seed
    assert retry.request is not None and retry.request.seed != step.request.seed and env.dialogue.sim_retries == 1
    reply = scenario.format_user_output("Who is this?", {"cooperation": 2, "emotion": 2, "trust": 2}, 0)
    answered = env.answer(TurnReply("x#0", reply, "fake", 0.0, 1))
    used = buffer.resp_len[0]
    assert answered.request is None and answered.outcome is None and answered.record.user_reply == "Who is this?"
    assert answered.record.policy_version == 7  # the version that sampled the turn, as the engine reported it
    assert buffer.ids[0, buffer.P + used - len(answered.user_ids):buffer.P + used].tolist() == answered.user_ids
    assert buffer.loss_mask[0, used - len(answered.user_ids):used].sum() == 0  # the user turn carries no loss
    claim = env.step(_ids(tok, agent_text(scenario, "All set.", status=1)))  # a claim of success is heard ...
    ended = env.answer(TurnReply("x#0", scenario.format_user_output("What?", {}, 0), "fake", 0.0, 1))
    assert claim.request is not None and ended.outcome is Outcome.AGENT_ENDED and not env.active  # ... not confirmed
    assert env.record().outcome == "agent_ended"
    with pytest.raises(RuntimeError, match="already ended"):
        env.step(_ids(tok, "more"))


def test_env_error_takes_the_row_out_of_the_loss(tok, scenario):
    env, buffer = _env(tok, scenario)
    step = env.step(_ids(tok, agent_text(scenario, "Hello.")))
    assert buffer.loss_mask[0].sum() > 0
    ended = env.answer(TurnFailure(step.request.dialogue_id, "all 3 attempts failed", 3))
    assert ended.outcome is Outcome.ERROR and buffer.loss_mask[0].sum() == 0
    assert env.dialogue.error == "user simulator turn failed: all 3 attempts failed"
    assert ended.record.user_error == "all 3 attempts failed"


def test_env_answers_for_another_dialogue_are_refused(tok, scenario):
    env, _ = _env(tok, scenario)
    env.step(_ids(tok, agent_text(scenario, "Hello.")))
    with pytest.raises(RuntimeError, match=r"answered 'y#0' for 'x#0'"):
        env.answer(TurnReply("y#0", "text", "fake", 0.0, 1))


def test_async_mode_needs_no_running_loop(tok, scenario):
    from tests.helpers.gen_loop_helpers import SCENARIO_PATH, ProgrammedPolicy

    loop = LLMGenerationManager(tok, ProgrammedPolicy(tok, {}), {
        "scenario": str(SCENARIO_PATH), "mode": "async", "max_turns": 2, "max_response_length": 512,
        "cache": {"enabled": False}, "controller": {"enabled": False}}, is_validation=True,
        client=ProgrammedSim(scenario, {}))

    async def inside_a_loop():
        loop.run_llm_loop(make_gen_batch(tok, scenario, ["a"]))

    with pytest.raises(RuntimeError, match="runs its own event loop"):
        asyncio.run(inside_a_loop())
