"""Graded turns: the probes re-request malformed replies as the rollout loop does, and turns rebuilt from a
rollout log are exactly the requests the loop sent."""
from __future__ import annotations

import copy
import json

from llm_agent.generation import LLMGenerationManager
from tests.helpers.record_factory import typed
from llm_agent.simulator_report import ProbeSampling, build_probe_set, dialogues_from_log, run_probes
from llm_agent.user_sim.client import SimulatorClient, TurnFailure, TurnReply, TurnRequest
from tests.helpers.gen_loop_helpers import ProgrammedPolicy, ProgrammedSim, agent_text, make_gen_batch
from tests.helpers.repo import SCENARIO_PATH
from tests.helpers.sim_report_fixtures import COST_DOUBT, reply_text


class FlakySim(SimulatorClient):
    """Answers request `probe-k/t`: malformed on the first attempt when t == 0, a TurnFailure for dialogue 1's
    turns, else a valid reply; records every request."""

    def __init__(self, scenario) -> None:
        self.scenario, self.requests = scenario, []

    def complete(self, requests: list[TurnRequest]) -> list[TurnReply | TurnFailure]:
        out = []
        for req in requests:
            self.requests.append(req)
            dialogue, turn = req.dialogue_id.split("/")
            tries = sum(r.dialogue_id == req.dialogue_id for r in self.requests)
            if dialogue == "probe-0001":
                out.append(TurnFailure(req.dialogue_id, "down", 3))
            elif turn == "0" and tries == 1:
                out.append(TurnReply(req.dialogue_id, "no tags at all", "fake:1", 0.5, 1))
            else:
                out.append(TurnReply(req.dialogue_id, reply_text(self.scenario, COST_DOUBT, (2, 2, 2)), "fake:1",
                                     0.25, 1))
        return out


def test_probes_rerequest_malformed_replies_with_new_seeds_but_not_failures(scenario):
    probes = build_probe_set(scenario, n_dialogues=3, seed=11)
    sim = FlakySim(scenario)
    graded = run_probes(sim, probes, scenario, ProbeSampling(reply_retries=2, seed=3), concurrency=2)
    assert [d.dialogue_id for d in graded] == [d.dialogue_id for d in probes.dialogues]
    for dialogue, probe in zip(graded, probes.dialogues):
        assert [t.messages for t in dialogue.turns] == [t.messages for t in probe.turns]
        for t, turn in enumerate(dialogue.turns):
            if dialogue.dialogue_id == "probe-0001":
                assert turn.replies == () and turn.failure == "down"
            elif t == 0:
                assert len(turn.replies) == 2 and turn.replies[0] == "no tags at all" and turn.latencies_s == (0.5, 0.25)
            else:
                assert len(turn.replies) == 1 and turn.failure is None
    first = [r for r in sim.requests if r.dialogue_id == "probe-0000/0"]
    assert len(first) == 2 and first[0].seed != first[1].seed
    assert len(sim.requests) == probes.n_requests + sum(1 for d in probes.dialogues if d.dialogue_id != "probe-0001")


class Recording(SimulatorClient):
    """A client that passes requests on and keeps a copy of each one's messages as they were when sent (the loop
    keeps growing a dialogue's message list after the request)."""

    def __init__(self, inner) -> None:
        self.inner, self.sent = inner, []

    def complete(self, requests: list[TurnRequest]) -> list[TurnReply | TurnFailure]:
        self.sent += [(r.dialogue_id, copy.deepcopy(r.messages)) for r in requests]
        return self.inner.complete(requests)


def test_turns_rebuilt_from_the_log_are_the_requests_the_loop_sent(tok, scenario, tmp_path, monkeypatch, capsys):
    a = lambda reply, **kw: agent_text(scenario, reply, **kw)  # noqa: E731
    # stage 0 turns may be answered from the cache (hit rate 1 once a reply is stored); stage 1+ never are
    agents = {
        "x": [a("Hello, this is Mia from FoodLoop."), "no tags: a format error", a("Is this the manager?"),
              a("It is free.", stage=1), a("Open the app.", stage=2)],
        "y": [a("Hello, this is Mia.", stage=1), a("Bye.", stage=1, status=-1)],
        "z": [a("Hi, I'm Mia from FoodLoop.", stage=1), a("Anything else?", stage=1)],
    }
    sims = {"x": [("Who?", 0), ("Yes.", 0), ("Free?", 0), ("Done.", 0)], "y": [("Who is this?", 0)],
            "z": [("Go on.", 0), "malformed reply"]}
    policy, sim = ProgrammedPolicy(tok, agents), Recording(ProgrammedSim(scenario, sims))
    config = {"scenario": str(SCENARIO_PATH), "max_turns": 5, "max_tokens_per_turn": 128, "max_response_length": 2048,
              "max_user_tokens": 64, "controller": {"enabled": False},
              "cache": {"enabled": True, "min_bucket_size": 1, "stage_hit_rates": {0: 1.0, 1: 0.0, 2: 0.0, 3: 0.0},
                        "path": str(tmp_path / "cache.jsonl")},
              "rollout_log_path": str(tmp_path / "rollouts.jsonl"), "val_metrics_path": str(tmp_path / "val.jsonl")}
    loop = LLMGenerationManager(tok, policy, config, is_validation=False, client=sim)
    out = loop.run_llm_loop(make_gen_batch(tok, scenario, list(agents)))
    loop.on_train_step_end(out, step=1)
    loop.close()
    records = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    sources = {s for r in records for s in (t["user_source"] for t in r["turns"])}
    assert {"simulator", "cache", "format_error"} <= sources, sources
    assert {r["outcome"] for r in records} >= {"agent_ended", "error"}
    rebuilt = {d.dialogue_id: d for d in dialogues_from_log(typed(records), scenario)}
    for record in records:
        sent = []
        for dialogue_id, messages in sim.sent:  # this dialogue's distinct requests in order (a re-request repeats)
            if dialogue_id == record["dialogue_id"] and (not sent or sent[-1] != messages):
                sent.append(messages)
        turns = rebuilt[record["dialogue_id"]].turns
        assert [t.messages for t in turns] == sent, record["dialogue_id"]
        assert rebuilt[record["dialogue_id"]].logged_rerequests == record["sim_retries"]
    z = rebuilt[next(r["dialogue_id"] for r in records if r["outcome"] == "error")]
    assert z.turns[-1].replies == () and "malformed" in z.turns[-1].failure
    assert all(t.replies and not t.first_try_known for d in rebuilt.values() for t in d.turns if not t.failure)
    # two runs' logs (both named rollouts.jsonl) get a card each, named after the run and split: the second once
    # overwrote the first's outputs/simulator_reports/rollouts.json
    from for_evaluation import simulator_report

    monkeypatch.chdir(tmp_path)
    log = (tmp_path / "rollouts.jsonl").read_text()
    for run in ("run_a", "run_b"):
        path = tmp_path / "outputs" / "rollouts" / run / "rollouts.jsonl"
        path.parent.mkdir(parents=True)
        path.write_text(log)
        assert simulator_report.main(["--dialogues", f"outputs/rollouts/{run}/rollouts.jsonl", "--split", "train",
                                      "--bootstrap", "5"]) == 0
    capsys.readouterr()
    cards = sorted(p.name for p in (tmp_path / "outputs" / "simulator_reports").iterdir())
    assert cards == ["run_a_train.json", "run_b_train.json"]
