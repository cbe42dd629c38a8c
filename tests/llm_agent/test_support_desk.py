"""The second shipped scenario, a support desk whose users have urgency and frustration (both better LOWER) instead
of cooperation, emotion and trust, trains, evaluates and renders its report with no code change.

One slow test end to end on CPU: the real trainer (Ray, 2 FSDP workers, the tiny model) for one GRPO step with
validation against a scripted simulator server started with the support desk; an evaluation of the scripted agent
(the dialogues' preconditions by construction: it follows the SOP, so calls complete and the users calm down); and
the HTML report of both. Every place that reads a user state reads the support desk's two dimensions: the rollout
log's profiles and state keys, the controller's weights, the cache's levels, the improvement metrics (`ui`, `fi`),
the failure labels and the report's plots, tables and dialogue browser.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from llm_agent.scenario import load_scenario, scenario_path

DESK = scenario_path("support_desk")
LOOP = "rollout_loop.config"


@pytest.fixture(scope="module")
def desk():
    return load_scenario(DESK)


def test_the_support_desk_is_a_scenario_of_its_own(desk):
    """Its schema comes from its file: two dimensions where lower is better, their own state keys and metrics."""
    from utils.check_scenario import check_scenario

    assert check_scenario(str(DESK)).name == "support_desk"
    assert desk.dims == ("urgency", "frustration") and [d.sign for d in desk.state_schema.dimensions] == [-1, -1]
    assert desk.state_key({"urgency": 3, "frustration": 1}) == "u3-f1"
    assert desk.state_schema.goodness({"urgency": 0, "frustration": 4}) == pytest.approx(0.5)
    assert "urgency 2" in desk.render_user_prompt(desk.profile((2, 3))) and "<urgency_score>" in \
        desk.render_agent_prompt()


def _prompt_files(out: Path, scenario) -> tuple[Path, Path]:
    from utils.create_prompt_data import prompt_rows, random_profiles, write_rows

    paths = []
    for split, n, seed in (("train", 8, 0), ("test", 4, 1)):
        rows = prompt_rows(scenario, random_profiles(scenario, n, seed), split)
        for row in rows:
            row["prompt"] = [{"role": "system", "content": scenario.agent_compact_prompt}, dict(row["prompt"][1])]
        paths.append(write_rows(rows, out / f"{split}.parquet"))
    return paths[0], paths[1]


def _train(model: str, root: Path, url: str, train: Path, test: Path) -> None:
    from verl.trainer.config_schema import compose_config

    from tests.helpers.sead_training_run import make_trainer

    config = compose_config([
        f"actor_rollout_ref.model.path={model}", f"data.train_files={train}", f"data.val_files={test}",
        "data.max_prompt_length=128", "data.max_response_length=320", "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4", "trainer.total_training_steps=1",
        "trainer.n_gpus_per_node=2", "trainer.device=cpu", "trainer.logger=[jsonl]", "trainer.save_freq=-1",
        f"trainer.default_local_dir={root / 'ckpt'}", f"trainer.log_dir={root / 'logs' / 'desk'}",
        "trainer.val_before_train=false", "trainer.test_freq=1",
        f"{LOOP}.scenario={DESK}", f"{LOOP}.max_turns=3", f"{LOOP}.max_tokens_per_turn=48",
        f"{LOOP}.max_user_tokens=32", f"{LOOP}.user_sim.urls='{url}'", f"{LOOP}.user_sim.timeout_s=10",
        f"{LOOP}.cache.path={root / 'cache.jsonl'}",
        f"{LOOP}.rollout_log_path={root / 'rollouts' / 'desk' / 'rollouts.jsonl'}",
        f"{LOOP}.val_metrics_path={root / 'evaluation' / 'desk' / 'val_metrics.jsonl'}",
    ], config_name="sead_trainer")
    trainer, pool = make_trainer(config)
    try:
        trainer.init_workers()
        trainer.fit()
    finally:
        trainer.shutdown()
        pool.remove()


@pytest.mark.extended  # 40 s measured: make test-extended (CI), out of make test's 20 minutes
@pytest.mark.slow
def test_the_support_desk_trains_evaluates_and_reports_with_no_code_change(desk, tiny_model_path, tok, tmp_path,
                                                                           ray_cluster):
    from llm_agent.evaluation.report import build_report
    from llm_agent.evaluation.run_data import resolve_run
    from llm_agent.evaluation.runner import EvalSettings, evaluate_agent
    from llm_agent.stand_ins.inprocess_user_sim import InProcessUserSim
    from llm_agent.stand_ins.scripted_policy import ScriptedPolicyWorkerGroup

    from tests.helpers.sim_servers import SimServers

    root = tmp_path / "outputs"
    train, test = _prompt_files(tmp_path / "data", desk)
    servers = SimServers(tmp_path)
    url = servers.start("--scenario", str(DESK))
    try:
        servers.wait_ready(url)
        _train(tiny_model_path, root, url, train, test)
    finally:
        servers.stop_all()

    # training: every dialogue logged with the desk's profile and state key; the metrics carry its dimensions
    lines = [json.loads(line) for line in (root / "rollouts" / "desk" / "rollouts.jsonl").read_text().splitlines()]
    assert {line["split"] for line in lines} == {"train", "val"} and len(lines) == 4 + 4
    for line in lines:
        profile = {k: v for k, v in line["profile"].items() if k != "behaviors"}
        desk.state_schema.check(profile)
        assert line["state_key"] == desk.state_key(profile) and line["state_key"].startswith("u")
        assert all(set(t["agent_state"]) == {"urgency", "frustration"} for t in line["turns"] if t["agent_state"])
    metrics = json.loads((root / "logs" / "desk" / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"dialogue/ui", "dialogue/fi", "val/dialogue/ui", "val/dialogue/fi"} <= set(metrics)
    assert not any(k.endswith(("/ei", "/ci", "/ti")) for k in metrics)
    assert any(k.startswith("controller/weight/urgency=") for k in metrics)
    assert any(k.startswith("controller/weight/frustration=") for k in metrics)
    assert "diagnosis/labels/hang_up_after_rise" in metrics

    # evaluation: the scripted agent follows the SOP, so calls complete and the callers end better off
    settings = EvalSettings(scenario=str(DESK), test_file=str(test), max_turns=8, max_tokens_per_turn=128,
                            max_response_length=2048, max_user_tokens=64)
    summary = evaluate_agent("scripted", ScriptedPolicyWorkerGroup(tok, desk, world_size=1), tok, settings,
                             root / "evaluation", client=InProcessUserSim(desk), n_resamples=50)
    results = summary.results["metrics"]
    assert results["completion_rate"]["value"] == 1.0
    assert results["fi"]["value"] > 0 and results["ui"]["value"] > 0  # less frustrated, less urgent: improvement

    # the report of the training run and of the evaluation: the desk's dimensions everywhere
    page = build_report(resolve_run(root / "logs" / "desk"), desk, tmp_path / "train.html", bootstrap=20).read_text()
    for needed in ('"dims":["urgency","frustration"]', "plot-controller_urgency", "plot-controller_frustration",
                   "<code>fi</code>", "the urgency improvement", "plot-cr_by_initial_state"):
        assert needed in page, needed
    assert "plot-controller_cooperation" not in page and "<code>ci</code>" not in page
    page = build_report(resolve_run(summary.dialogues_file), desk, tmp_path / "eval.html", bootstrap=20).read_text()
    assert '"dims":["urgency","frustration"]' in page and "<th>frustration</th>" in page
