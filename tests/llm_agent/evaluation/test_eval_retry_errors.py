"""`evaluate.py --retry-errors` (slow: a real simulator server on loopback): a first run in which the simulator
fails every request of a known set of profiles leaves exactly those dialogues in `error`; a plain rerun runs
nothing; a rerun with --retry-errors (the simulator healthy again) runs exactly those dialogues, appends them
and leaves every earlier line as it was."""
from __future__ import annotations

import json
import threading
import time

import pytest
import uvicorn

from llm_agent.evaluation.runner import dialogues_path, results_path
from llm_agent.evaluation.sims import free_port
from llm_agent.scenario import UserProfile
from llm_agent.user_sim.server.app import ServerConfig, build_app
from llm_agent.user_sim.server.scripted import ScriptedPersonaBackend
from utils.create_prompt_data import create_prompt_data
from verl.utils.dataset import RLHFDataset

from tests.helpers.for_evaluation_cli import load_script
from tests.helpers.repo import SCENARIO_PATH

pytestmark = pytest.mark.processes
N_DIALOGUES = 8
FAILING_ROWS = (1, 4, 6)


class FlakyPersona:
    """The scripted persona, answering HTTP 500 (an exception in the backend) to every request whose persona
    prompt is one of `failing` while `failing` is set; remembers the persona prompts it was asked with."""

    def __init__(self, scenario):
        self.persona = ScriptedPersonaBackend(scenario)
        self.failing: set[str] = set()
        self.seen: set[str] = set()

    def complete(self, messages, params):
        self.seen.add(messages[0]["content"])
        if messages[0]["content"] in self.failing:
            raise RuntimeError("injected simulator failure")
        return self.persona.complete(messages, params)


@pytest.fixture()
def flaky_sim(scenario):
    backend = FlakyPersona(scenario)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(backend, ServerConfig(served_model_name="user-sim")),
                                           host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        yield backend, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_retry_errors_reruns_exactly_the_error_dialogues(flaky_sim, scenario, tok, tiny_model_path, tmp_path):
    backend, url = flaky_sim
    test_file = str(create_prompt_data(SCENARIO_PATH, tmp_path / "data", train_samples=1, test_samples=N_DIALOGUES,
                                       seed=3)["test"])
    rows = RLHFDataset(test_file, tok, max_prompt_length=4096).rows
    personas = [scenario.render_user_prompt(UserProfile.from_dict(json.loads(rows[i]["user_profile"])))
                for i in range(N_DIALOGUES)]
    backend.failing = {personas[i] for i in FAILING_ROWS}
    expected_errors = {f"test{i}#0" for i in range(N_DIALOGUES) if personas[i] in backend.failing}
    assert len(expected_errors) < N_DIALOGUES

    evaluate = load_script("evaluate")
    out = tmp_path / "eval"
    argv = ["--agent", "good=scripted:good", "--tokenizer", tiny_model_path, "--test-file", test_file, "--out",
            str(out), "--user-sim-urls", url, "--sim-max-attempts", "2", "--sim-timeout-s", "10", "--max-turns", "8",
            "--max-tokens-per-turn", "256", "--max-response-length", "3072", "--chunk-size", "3",
            "--n-resamples", "50"]
    evaluate.run(evaluate.parse_args(argv))
    log = dialogues_path(out, "good")
    first = log.read_text()
    records = lines(log)
    assert [r["dialogue_id"] for r in records] == [f"test{i}#0" for i in range(N_DIALOGUES)]
    assert {r["dialogue_id"] for r in records if r["outcome"] == "error"} == expected_errors
    assert all("user simulator turn failed" in r["error"] for r in records if r["outcome"] == "error")
    assert json.loads(results_path(out, "good").read_text())["outcomes"]["error"] == len(expected_errors)

    backend.failing = set()
    backend.seen.clear()
    evaluate.run(evaluate.parse_args(argv))  # without --retry-errors an error dialogue counts as done
    assert log.read_text() == first and backend.seen == set()

    evaluate.run(evaluate.parse_args([*argv, "--retry-errors"]))
    text = log.read_text()
    assert text.startswith(first), "the first run's lines are left as they were"
    rerun = lines(log)[N_DIALOGUES:]
    assert sorted(r["dialogue_id"] for r in rerun) == sorted(expected_errors)
    assert backend.seen == {personas[int(d[4:-2])] for d in expected_errors}, "only those dialogues were run"
    assert all(r["outcome"] != "error" and r["error"] is None for r in rerun)
    results = json.loads(results_path(out, "good").read_text())
    assert results["n_dialogues"] == N_DIALOGUES and "error" not in results["outcomes"]
    latest = {r["dialogue_id"]: r["outcome"] for r in lines(log)}
    assert results["outcomes"] == {o: list(latest.values()).count(o) for o in set(latest.values())}
