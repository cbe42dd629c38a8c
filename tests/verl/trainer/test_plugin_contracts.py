"""The trainer's plug-in contracts (verl/trainer/ppo/plugins.py): each signature pinned, the single-turn default,
reward binding, and a trainer that calls the hooks directly."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from verl.protocol import DataProto
from verl.trainer.config_schema import ConfigError
from verl.trainer.ppo.plugins import BatchOutputs, RolloutLoop, SingleTurnRollout, bind_reward, declared_outputs
from verl.workers.rollout.engine import RolloutEngine

REPO = Path(__file__).resolve().parents[3]

# name -> (parameters after self, return annotation) of every method of the rollout-loop contract
ROLLOUT_LOOP = {
    "__init__": (["tokenizer", "engine", "config", "is_validation"], "None"),
    "run_llm_loop": (["gen_batch"], "DataProto"),
    "start_llm_loop": (["gen_batch"], "Callable[[], DataProto]"),
    "state_dict": ([], "Mapping[str, Any] | None"),
    "load_state_dict": (["state"], "None"),
    "on_train_step_end": (["batch", "step"], "dict[str, float]"),
    "on_validation_end": (["batches", "step"], "dict[str, float]"),
    "save_checkpoint": (["directory"], "None"),
    "load_checkpoint": (["directory"], "None"),
    "close": ([], "None"),
    "batch_outputs": (["config"], "Optional[BatchOutputs]"),
}


def _signature(fn) -> tuple[list[str], str]:
    sig = inspect.signature(fn)
    return [p for p in sig.parameters if p != "self"], str(sig.return_annotation)


def test_rollout_loop_contract_is_pinned():
    methods = {name for name, value in vars(RolloutLoop).items()
               if (callable(value) or isinstance(value, classmethod)) and not name.startswith("_")}
    assert methods | {"__init__"} == set(ROLLOUT_LOOP)
    assert RolloutLoop.console_metrics == () and "console_metrics" in RolloutLoop.__annotations__
    for name, expected in ROLLOUT_LOOP.items():
        assert _signature(getattr(RolloutLoop, name)) == expected, name
    assert RolloutLoop.__abstractmethods__ == frozenset({"run_llm_loop"})


class _Minimal(RolloutLoop):
    def run_llm_loop(self, gen_batch: DataProto) -> DataProto:
        return gen_batch


class _Engine(RolloutEngine):
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        self.seen = prompts
        return self.versioned(DataProto.from_dict(tensors={"responses": prompts.batch["input_ids"] + 1}))


def test_every_hook_has_a_no_op_default():
    loop = _Minimal(tokenizer=None, engine=_Engine(), config={}, is_validation=True)
    batch = DataProto.from_dict(tensors={"responses": torch.zeros(2, 3, dtype=torch.long)})
    assert loop.is_validation is True and loop.console_metrics == () and loop.state_dict() is None
    assert loop.on_train_step_end(batch, 1) == {} and loop.on_validation_end([batch], 1) == {}
    assert loop.load_state_dict({}) is None and loop.save_checkpoint("/nonexistent") is None
    assert loop.load_checkpoint("/nonexistent") is None and loop.close() is None
    assert _Minimal.batch_outputs({}) is None  # undeclared: the config check can only warn
    with pytest.raises(NotImplementedError, match=r"_Minimal runs one rollout at a time .* async_training.rollouts_in_flight=1"):
        loop.start_llm_loop(batch)  # one rollout at a time unless the loop says otherwise
    with pytest.raises(TypeError, match="abstract"):
        RolloutLoop(tokenizer=None, engine=_Engine(), config={}, is_validation=False)


def test_a_loop_generates_through_a_rollout_engine_only():
    class Group:  # a worker group's methods, but not the contract
        world_size = 1

        def generate_sequences(self, data):
            return data

    with pytest.raises(TypeError, match="RolloutEngine, got Group"):
        _Minimal(tokenizer=None, engine=Group(), config={}, is_validation=False)


def test_single_turn_rollout_sends_only_tensors_and_meta_to_the_workers():
    group = _Engine()
    loop = SingleTurnRollout(tokenizer=None, engine=group, config={}, is_validation=False)
    ids = torch.arange(6).view(2, 3)
    batch = DataProto.from_dict(tensors={"input_ids": ids}, non_tensors={"uid": ["a", "b"]},
                                meta_info={"temperature": 0.5})
    out = loop.run_llm_loop(batch)
    assert torch.equal(out.batch["responses"], ids + 1)
    assert group.seen.non_tensor_batch == {} and group.seen.meta_info == {"temperature": 0.5}


def test_single_turn_rollout_started_ahead_generates_when_run():
    group = _Engine()
    loop = SingleTurnRollout(tokenizer=None, engine=group, config={}, is_validation=False)
    ids = torch.arange(6).view(2, 3)
    run = loop.start_llm_loop(DataProto.from_dict(tensors={"input_ids": ids}))
    assert not hasattr(group, "seen")  # nothing generated until it runs
    assert torch.equal(run().batch["responses"], ids + 1)


def _reward(data: DataProto, tokenizer, scale: float = 1.0) -> tuple[torch.Tensor, dict[str, float]]:
    return torch.full(data.batch["responses"].shape, scale), {"rows": float(len(data))}


def test_bind_reward_checks_the_kwargs_at_start_and_the_result_when_called():
    data = DataProto.from_dict(tensors={"responses": torch.zeros(2, 4, dtype=torch.long)})
    scores, metrics = bind_reward(_reward, None, {"scale": 2.0})(data)
    assert torch.equal(scores, torch.full((2, 4), 2.0)) and metrics == {"rows": 2.0}
    with pytest.raises(ConfigError, match=r"reward\.kwargs\.scael: reward\.path cannot be called"):
        bind_reward(_reward, None, {"scael": 2.0})
    with pytest.raises(TypeError, match="must return"):
        bind_reward(lambda data, tokenizer: 1.0, None, {})(data)
    with pytest.raises(ValueError, match=r"shape \(2, 3\)"):
        bind_reward(lambda data, tokenizer: (torch.zeros(2, 3), {}), None, {})(data)


def test_the_built_in_task_reward_is_a_reward_function():
    from verl.tasks.repeat_letter import compute_reward

    params = list(inspect.signature(compute_reward).parameters)
    assert params[:2] == ["data", "tokenizer"]
    bind_reward(compute_reward, None, {})


def test_the_trainer_calls_the_rollout_loop_hooks_directly():
    """No probing of the plug-in: the trainer modules never ask whether the loop has a hook."""
    for path in (REPO / "verl/trainer/ppo").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("hasattr", "getattr") and \
                    node.args and "rollout_loop" in ast.unparse(node.args[0]):
                pytest.fail(f"{path.name}:{node.lineno}: {ast.unparse(node)}")


def test_the_trainer_refuses_a_rollout_loop_that_is_not_a_rollout_loop(tmp_path):
    from verl.trainer.config_schema import compose_config
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    train = tmp_path / "train.parquet"
    train.write_bytes(b"")
    config = compose_config([f"actor_rollout_ref.model.path={tmp_path}", f"data.train_files={train}",
                             "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
                             "rollout_loop.path=verl.protocol.DataProto"])
    with pytest.raises(TypeError, match=r"rollout_loop\.path='verl\.protocol\.DataProto' must name a subclass of "
                                        r"verl\.trainer\.ppo\.plugins\.RolloutLoop"):
        RayPPOTrainer(config, tokenizer=None, role_worker_mapping={}, resource_pool=None, train_dataset=[])


def test_what_the_shipped_plugins_declare_they_write():
    from llm_agent.generation import LLMGenerationManager
    from llm_agent.reward import compute_reward
    from verl.tasks.repeat_letter import compute_reward as letter_reward

    assert declared_outputs(SingleTurnRollout, {}) == BatchOutputs() == declared_outputs(LLMGenerationManager, {})
    assert declared_outputs(letter_reward, {}) == BatchOutputs()
    plain = declared_outputs(compute_reward, {})
    assert plain.written == {"turn_labels"} and "reward.kwargs.turn_weights.state_change" in plain.enabled_by["turn_scores"]
    assert declared_outputs(compute_reward, {"turn_weights": {"format": 0.5}}).written == {"turn_labels", "turn_scores"}
    with pytest.raises(ValueError, match=r"reward\.kwargs\.turn_weights: unknown component"):
        declared_outputs(compute_reward, {"turn_weights": {"bogus": 1.0}})
    assert declared_outputs(lambda data, tokenizer: None, {}) is None


def test_the_trainer_refuses_rollouts_in_flight_with_a_loop_that_runs_one_at_a_time(tmp_path):
    from verl.trainer.config_schema import compose_config
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    train = tmp_path / "train.parquet"
    train.write_bytes(b"")
    config = compose_config([f"actor_rollout_ref.model.path={tmp_path}", f"data.train_files={train}",
                             "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
                             "actor_rollout_ref.rollout.calculate_log_probs=true",
                             "algorithm.rollout_correction.rollout_is=token", "async_training.staleness_threshold=2",
                             "async_training.partial_rollout=true", "async_training.rollouts_in_flight=2",
                             f"rollout_loop.path={__name__}._Minimal"])
    with pytest.raises(ConfigError, match=r"rollouts_in_flight=2: the rollout loop _Minimal runs one rollout at a "
                                          r"time .* set async_training.rollouts_in_flight=1"):
        RayPPOTrainer(config, tokenizer=None, role_worker_mapping={}, resource_pool=None, train_dataset=[])
