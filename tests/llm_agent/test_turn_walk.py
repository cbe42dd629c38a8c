"""docs/architecture.md's walk of one turn: at most eight files, each name defined in its file, and a real step's
rollout (the trainer's StepRollouts, the configured rollout loop and reward, a scripted policy behind the
trainer's WorkerGroupEngine, a scripted simulator server over HTTP) calls them in the order the page lists."""
from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path

import pytest

from verl.trainer.config_schema import compose_config
from verl.trainer.config_validation import load_config
from verl.trainer.ppo.plugins import bind_reward, import_dotted
from verl.trainer.ppo.trainer_rollout import StepRollouts
from verl.workers.rollout.replicas import WorkerGroupEngine
from llm_agent.stand_ins.scripted_policy import ScriptedPolicyWorkerGroup

from tests.helpers.gen_loop_helpers import make_gen_batch
from tests.helpers.repo import REPO
from tests.helpers.sim_servers import SimServers

pytestmark = pytest.mark.processes


def walk() -> list[tuple[str, list[str]]]:
    """(file, names) per numbered line of the page's "The walk of one turn" section."""
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## The walk of one turn", 1)[1].split("\n## ", 1)[0]
    steps = []
    for line in section.splitlines():
        if re.match(r"\d+\. `", line):
            path, *names = re.findall(r"`([^`]+)`", line.split(":", 1)[0])
            steps.append((path, names))
    return steps


def resolve(path: str, name: str):
    """The function ``name`` (``f`` or ``Class.method``) of the module at ``path``."""
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    obj = module
    for part in name.split("."):
        obj = getattr(obj, part)
    return inspect.unwrap(obj)


def test_the_walk_is_at_most_eight_files_and_each_name_is_defined_in_its_file():
    steps = walk()
    assert 3 <= len(steps) <= 8 and len({path for path, _ in steps}) == len(steps)
    for path, names in steps:
        assert (REPO / path).is_file() and names, path
        for name in names:
            assert Path(inspect.getsourcefile(resolve(path, name))) == REPO / path, (path, name)


def test_one_step_calls_the_walk_in_order(tok, scenario, tiny_model_path, tmp_path):
    train = tmp_path / "train.parquet"
    train.write_bytes(b"x")
    with SimServers(tmp_path / "sims") as servers:
        url = servers.start_many(1)[0]
        cfg = load_config(compose_config([
            f"actor_rollout_ref.model.path={tiny_model_path}", f"data.train_files={train}",
            "actor_rollout_ref.rollout.n=2", "rollout_loop.config.max_turns=2",
            "rollout_loop.config.cache.enabled=false", "rollout_loop.config.controller.enabled=false",
            f"rollout_loop.config.user_sim.urls=[{url}]",
            f"rollout_loop.config.rollout_log_path={tmp_path / 'rollouts.jsonl'}",
            f"rollout_loop.config.val_metrics_path={tmp_path / 'val.jsonl'}"], config_name="sead_trainer"),
            check_paths=False)
        engine = WorkerGroupEngine(ScriptedPolicyWorkerGroup(tok, scenario, world_size=1))
        loop = import_dotted(cfg.rollout_loop.path, "rollout_loop.path")(
            tokenizer=tok, engine=engine, config=cfg.rollout_loop.config, is_validation=False)
        reward = bind_reward(import_dotted(cfg.reward.path, "reward.path"), tok, dict(cfg.reward.kwargs))
        rollouts = StepRollouts(cfg, loop, loop, reward, next_prompts=lambda: None)
        steps = walk()
        expected = {resolve(path, name).__code__: (index, f"{path} {name}")
                    for index, (path, names) in enumerate(steps) for name in names}
        first_calls: list = []

        def profile(frame, event, arg):
            if event == "call" and frame.f_code in expected and frame.f_code not in first_calls:
                first_calls.append(frame.f_code)

        sys.setprofile(profile)
        try:
            batch, metrics = rollouts.train_batch(make_gen_batch(tok, scenario, ["a"]), 1, {})
        finally:
            sys.setprofile(None)
            loop.close()
    assert batch.batch["token_level_scores"].shape == batch.batch["responses"].shape == (2, batch.batch[
        "responses"].shape[1])
    assert any(key.startswith("reward/") for key in metrics)
    missing = [name for code, (_, name) in expected.items() if code not in first_calls]
    assert missing == [], "listed in the walk but not called by one step"
    files_in_call_order = list(dict.fromkeys(expected[code][0] for code in first_calls))
    assert files_in_call_order == list(range(len(steps))), [steps[i][0] for i in files_in_call_order]
