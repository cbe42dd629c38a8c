"""Live evaluation (slow): an agent served over a real OpenAI-compatible HTTP endpoint, evaluate.py on a trainer
checkpoint against simulators it starts itself (interrupted and resumed), and a simulator killed mid-evaluation."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import uvicorn

from llm_agent.evaluation.agents import OpenAIChatAgent
from llm_agent.evaluation.runner import EvalSettings, dialogues_path, evaluate_agent
from llm_agent.evaluation.sims import LocalSimulators, free_port
from llm_agent.stand_ins.inprocess_user_sim import InProcessUserSim
from llm_agent.stand_ins.scripted_policy import ScriptedAgent, ScriptedPolicyWorkerGroup
from llm_agent.user_sim.server.app import ServerConfig, build_app
from llm_agent.user_sim.server.backend import BackendResult, Completion
from utils.create_prompt_data import create_prompt_data

from tests.helpers.checkpoint_fixtures import write_checkpoint
from tests.helpers.repo import REPO, SCENARIO_PATH

pytestmark = pytest.mark.processes


class ScriptedAgentBackend:
    """Serves the scripted agent as a chat model: the messages after the system prompt are its history."""

    def __init__(self, scenario):
        self.agent = ScriptedAgent(scenario, quality="good")

    def complete(self, messages, params):
        text = self.agent.respond([(m["role"], m["content"]) for m in messages[1:]])
        return BackendResult([Completion(text, "stop", len(text.split()))], prompt_tokens=1)


@pytest.fixture(scope="module")
def test_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("prompt_data")
    return str(create_prompt_data(SCENARIO_PATH, out, train_samples=1, test_samples=8, seed=5)["test"])


def settings(test_file, **overrides):
    values = dict(scenario=str(SCENARIO_PATH), test_file=test_file, max_dialogues=8, max_turns=8,
                  max_tokens_per_turn=256, max_response_length=3072)
    values.update(overrides)
    return EvalSettings(**values)


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_an_agent_behind_an_openai_endpoint_holds_the_same_dialogues(tok, scenario, test_file, tmp_path):
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(ScriptedAgentBackend(scenario), ServerConfig(
        served_model_name="scripted-agent", api_key="k")), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        agent = OpenAIChatAgent(f"http://127.0.0.1:{port}", tok, api_key="k", concurrency=4)
        assert agent.model == "scripted-agent"  # discovered from /v1/models
        evaluate_agent("endpoint", agent, tok, settings(test_file), tmp_path, client=InProcessUserSim(scenario),
                       chunk_size=4, n_resamples=50)
        agent.close()
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    direct = ScriptedPolicyWorkerGroup(tok, scenario, world_size=1)
    evaluate_agent("direct", direct, tok, settings(test_file), tmp_path, client=InProcessUserSim(scenario),
                   chunk_size=4, n_resamples=50)
    via_http, local = lines(dialogues_path(tmp_path, "endpoint")), lines(dialogues_path(tmp_path, "direct"))
    assert agent.requests == sum(r["num_turns"] for r in via_http) > 8
    assert "completed" in {r["outcome"] for r in via_http}
    for got, want in zip(via_http, local):
        assert (got["dialogue_id"], got["outcome"]) == (want["dialogue_id"], want["outcome"])
        assert [t["agent_text"] for t in got["turns"]] == [t["agent_text"] for t in want["turns"]]


def test_killing_one_of_two_simulators_loses_no_dialogue(tok, scenario, test_file, tmp_path):
    reference = ScriptedPolicyWorkerGroup(tok, scenario, world_size=1)
    evaluate_agent("reference", reference, tok, settings(test_file), tmp_path, client=InProcessUserSim(scenario),
                   chunk_size=2, n_resamples=20)
    sims = LocalSimulators(2, str(SCENARIO_PATH), tmp_path / "sims")
    sims.start()
    log = dialogues_path(tmp_path, "killed")
    try:
        def kill_after_first_chunk():
            while not log.exists():
                time.sleep(0.02)
            proc = sims.procs[sims.urls[0]]
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

        killer = threading.Thread(target=kill_after_first_chunk)
        killer.start()
        summary = evaluate_agent("killed", ScriptedPolicyWorkerGroup(tok, scenario, world_size=1), tok,
                                 settings(test_file, user_sim={"timeout_s": 5.0, "max_attempts": 3}), tmp_path,
                                 user_sim_urls=sims.urls, chunk_size=2, n_resamples=20)
        killer.join(timeout=30)
    finally:
        sims.stop()
    assert sims.procs[sims.urls[0]].returncode == -signal.SIGKILL, "the first simulator was killed mid-run"
    got, want = lines(log), lines(dialogues_path(tmp_path, "reference"))
    assert summary.n_run == 8 and [r["dialogue_id"] for r in got] == [f"test{i}#0" for i in range(8)]
    assert [r["outcome"] for r in got] == [r["outcome"] for r in want], "no dialogue lost or mislabelled"
    assert all(r["error"] is None for r in got)


def _evaluate_cmd(model, test_file, out):
    return [sys.executable, str(REPO / "for_evaluation" / "evaluate.py"), "--agent", f"warm={model}", "--engine",
            "hf", "--test-file", test_file, "--out", str(out), "--max-turns", "3", "--max-tokens-per-turn", "48",
            "--max-response-length", "400", "--chunk-size", "1", "--n-resamples", "50", "--num-sims", "2"]


@pytest.mark.extended  # 35 s measured: make test-extended (CI), out of make test's 20 minutes
@pytest.mark.slow
def test_evaluate_cli_on_a_trainer_checkpoint_is_resumed_after_a_kill(warm_model_path, test_file, tmp_path):
    # the checkpoint root as the CPU demo leaves it (trainer.save_hf_model=every): its latest step is evaluated
    checkpoint = tmp_path / "checkpoints"
    write_checkpoint(warm_model_path, checkpoint, step=2, hf_export=True)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = tmp_path / "eval"
    log = dialogues_path(out, "warm")
    # the evaluation must get SIGINT's default action even where pytest inherited SIGINT ignored (a background job
    # of a non-interactive shell): an ignored disposition survives exec, a handler is reset to the default
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        first = subprocess.Popen(_evaluate_cmd(checkpoint, test_file, out), cwd=tmp_path, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    finally:
        signal.signal(signal.SIGINT, inherited)
    # one dialogue per chunk (~0.25 s each here): interrupted as soon as the first is logged, 7 chunks before the end
    deadline = time.monotonic() + 240
    while not (log.exists() and log.read_text().count("\n") >= 1):
        assert first.poll() is None, "the evaluation ended before its first dialogue was seen"
        assert time.monotonic() < deadline, "no chunk finished in 240 s"
        time.sleep(0.01)
    first.send_signal(signal.SIGINT)
    text = first.communicate(timeout=60)[0]
    assert "scripted simulators" in text, text[-3000:]
    pids = [int(p) for p in re.findall(r"\d+", re.search(r"scripted simulators: .*\(PIDs \[(.*)\]\)", text).group(1))]
    assert all(not os.path.exists(f"/proc/{pid}") for pid in pids), "the started simulators must be stopped"
    done_before = lines(log)
    assert 1 <= len(done_before) < 8, f"not interrupted between its first and last dialogue: {text[-3000:]}"

    second = subprocess.run(_evaluate_cmd(checkpoint, test_file, out), cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    n = len(done_before)
    assert f"warm at global_step 2: 8 dialogues ({n} resumed, {8 - n} run)" in second.stdout
    final = lines(log)
    assert final[:n] == done_before and [r["dialogue_id"] for r in final] == [f"test{i}#0" for i in range(8)]
    results = json.loads((out / "warm_results.json").read_text())
    assert results["agent"] == f"{checkpoint} (hf)"
    assert (results["global_step"], results["checkpoint"]) == (2, str(checkpoint / "global_step_2"))
    assert results["n_dialogues"] == 8 and set(results["metrics"]) >= {"completion_rate", "upa", "att"}
    assert all(r["num_turns"] == len(r["turns"]) >= 1 and r["split"] == "eval" for r in final)

