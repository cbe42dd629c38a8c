"""UserSimClient against real simulator servers (subprocesses on free ports) with injected faults.

The fast tests cover URL parsing, request validation and the all-dead path (nothing listens on the ports).
The slow ones start `python -m llm_agent.user_sim.server --backend scripted` processes, kill some by PID in the
middle of a batch, and check that every dialogue is still answered (or reported as a TurnFailure) in time.
"""
from __future__ import annotations

import asyncio
import functools
import re
import threading
import time
from pathlib import Path

import pytest

from llm_agent.scenario import DEFAULT_SCENARIO_PATH, load_scenario
from llm_agent.user_sim.client import TurnFailure, TurnReply, TurnRequest, UserSimClient, parse_urls

from tests.helpers.sim_servers import SimServers, free_port
from tests.helpers.profiles import profile3

REPO = Path(__file__).resolve().parents[3]
SCENARIO = DEFAULT_SCENARIO_PATH


@functools.cache
def personas() -> tuple[str, ...]:
    """The scenario's persona prompt for every initial state (what the rollout loop sends as `system`)."""
    scenario = load_scenario(SCENARIO)
    return tuple(scenario.render_user_prompt(profile3(*state)) for state in scenario.state_space())


def dialogue_requests(n: int, prefix: str = "d") -> list[TurnRequest]:
    """`n` first turns as the rollout loop sends them: the persona, then the agent's opening words."""
    return [
        TurnRequest(
            dialogue_id=f"{prefix}{i}",
            messages=[
                {"role": "system", "content": personas()[i % len(personas())]},
                {"role": "user", "content": f"Hello, this is Anna from the delivery app, call number {i}."},
            ],
            seed=i,
            max_tokens=128,
        )
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def sims(tmp_path_factory):
    """Two healthy servers (20 ms median latency); one that hangs, one answering garbage, one answering 503;
    one that requires an API key."""
    servers = SimServers(tmp_path_factory.mktemp("user_sim_logs"))
    latency = ("--inject-latency-ms", "20", "--inject-latency-sigma", "0.3")
    urls = {
        "a": servers.start(*latency, "--seed", "1"),
        "b": servers.start(*latency, "--seed", "2"),
        "hang": servers.start("--inject-fault", "hang"),
        "garbage": servers.start("--inject-fault", "garbage"),
        "error": servers.start("--inject-fault", "error"),
        "auth": servers.start(env={"SEAD_USER_SIM_API_KEY": "s3cret"}),
    }
    try:
        servers.wait_ready(*urls.values())
        servers.urls = urls
        yield servers
    finally:
        servers.stop_all()


def replies_by_instance(results: list) -> dict[str, int]:
    """How many TurnReply results each instance served."""
    counts: dict[str, int] = {}
    for r in results:
        if isinstance(r, TurnReply):
            counts[r.instance] = counts.get(r.instance, 0) + 1
    return counts


def name(url: str) -> str:
    return url.removeprefix("http://")


def assert_all_answered(results: list, requests: list[TurnRequest]) -> None:
    """Every request got a non-empty TurnReply for its own dialogue, in order."""
    assert len(results) == len(requests)
    failures = [r for r in results if isinstance(r, TurnFailure)]
    assert not failures, f"{len(failures)} turns failed, first: {failures[0]}"
    for req, res in zip(requests, results):
        assert res.dialogue_id == req.dialogue_id
        assert isinstance(res.text, str) and res.text.strip()


def test_parse_urls_comma_string_and_lists():
    assert parse_urls(" http://127.0.0.1:5000/ ,http://127.0.0.1:5001//,https://sim.example/v1/") == [
        "http://127.0.0.1:5000", "http://127.0.0.1:5001", "https://sim.example"]
    assert parse_urls(["http://h:1"]) == ["http://h:1"]
    with pytest.raises(ValueError, match="no user-simulator url"):
        parse_urls(" , ")
    with pytest.raises(ValueError, match=r"#1 'localhost:5001' is not an http"):
        parse_urls("http://localhost:5000,localhost:5001")
    with pytest.raises(ValueError, match="listed twice"):
        parse_urls("http://h:1/,http://h:1")
    with UserSimClient("http://127.0.0.1:5000/, http://127.0.0.1:5001") as client:
        assert client.instances == ["127.0.0.1:5000", "127.0.0.1:5001"]


@pytest.mark.parametrize("url", ["http://sim-user:s3cret@127.0.0.1:5000", "https://s3cret@sim.example/v1",
                                 "sim-user:s3cret@127.0.0.1:5000", "http://sim-user:pa/s3cret@host:1"])
def test_a_url_carrying_credentials_is_refused_without_repeating_them(url):
    refusal = r"#1 '.*<credentials removed>@.*' carries a user name or password.*SEAD_USER_SIM_API_KEY"
    with pytest.raises(ValueError, match=refusal) as err:
        parse_urls(f"http://127.0.0.1:4999,{url}")
    assert "s3cret" not in str(err.value) and "sim-user" not in str(err.value)
    with pytest.raises(ValueError, match="SEAD_USER_SIM_API_KEY"):
        UserSimClient(url)


@pytest.mark.parametrize("url, message", [
    ("http://sim:5000/v1?token=s3cret", "carries a query string or fragment"),
    ("http://sim:5000/?api_key=s3cret", "carries a query string or fragment"),
    ("http://sim:5000/#s3cret", "carries a query string or fragment"),
    ("ftp://sim:5000", "is not an http(s)://host[:port] URL"), ("http://sim:99999", "port in 1-65535"),
    ("http://sim:-1", "port in 1-65535"), ("http://sim:0", "port in 1-65535"), ("http://sim:x", "port in 1-65535"),
    ("http://:5000", "is not an http(s)"), ("http://sim:5000\r\nX-Token: s3cret", "contains a carriage return"),
    ("http://sim:5000/\ns3cret", "contains a line break"), ("http://sim:5000/a b", "contains a space"),
    ("http://sim:5000/'x", "contains a quote"), ('http://sim:5000/"x', "contains a quote"),
    ("http://sim:5000/\x00x", "contains '\\x00'"),
])
def test_a_url_no_client_can_use_safely_is_refused_naming_it(url, message):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        parse_urls(["http://127.0.0.1:4999", url])
    assert str(err.value).startswith("user-simulator url #1") and "s3cret" not in str(err.value)


def test_bad_arguments_are_rejected_with_the_field_name():
    with pytest.raises(ValueError, match=r"messages\[1\]\['content'\]"):
        TurnRequest("x", [{"role": "system", "content": "hi"}, {"role": "user", "content": None}])
    with pytest.raises(ValueError, match="top_p"):
        TurnRequest("x", [{"role": "user", "content": "hi"}], top_p=0.0)
    with pytest.raises(ValueError, match="max_attempts"):
        UserSimClient("http://h:1", max_attempts=0)
    with UserSimClient("http://h:1") as client, pytest.raises(TypeError, match=r"requests\[0\]"):
        client.complete([{"dialogue_id": "x"}])
    client.close()
    with pytest.raises(RuntimeError, match="after close"):
        client.complete(dialogue_requests(1))


def test_all_instances_dead_gives_turn_failures_within_deadline():
    urls = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    requests = dialogue_requests(40)
    with UserSimClient(urls, model="m", timeout_s=0.5, max_attempts=20, deadline_s=1.5, backoff_s=0.05,
                       probe_interval_s=0.2) as client:
        start = time.monotonic()
        results = client.complete(requests)
        elapsed = time.monotonic() - start
        stats = client.stats()
    assert elapsed < 1.5 + 1.0, elapsed  # without the deadline: up to 20 attempts x 0.5 s
    assert all(isinstance(r, TurnFailure) for r in results)
    assert [r.dialogue_id for r in results] == [r.dialogue_id for r in requests]
    assert all(r.attempts >= 1 and len(r.errors) == r.attempts for r in results)
    assert all("deadline" in r.reason for r in results)
    assert any("ClientConnectorError" in e for r in results for e in r.errors)
    assert stats["user_sim/turn_failures"] == 40 and stats["user_sim/instances_down"] == 2


@pytest.mark.processes
def test_load_splits_evenly_over_two_servers(sims):
    a, b = sims.urls["a"], sims.urls["b"]
    requests = dialogue_requests(200)
    with UserSimClient(f"{a},{b}", timeout_s=10) as client:
        results = client.complete(requests)
        stats = client.stats()
    assert_all_answered(results, requests)
    counts = replies_by_instance(results)
    assert set(counts) == {name(a), name(b)}
    assert 0.35 * 200 <= counts[name(a)] <= 0.65 * 200, counts
    shed = sum(stats[f"user_sim/{name(u)}/failures_overloaded"] for u in (a, b))  # re-sent, a request each
    assert stats[f"user_sim/{name(a)}/requests"] + stats[f"user_sim/{name(b)}/requests"] == 200 + shed
    assert stats["user_sim/turns"] == 200 and stats["user_sim/turn_failures"] == 0
    assert 0.01 < stats["user_sim/latency_p50_s"] <= stats["user_sim/latency_p95_s"] < 5


@pytest.mark.processes
def test_concurrent_batches_from_two_threads(sims):
    a, b = sims.urls["a"], sims.urls["b"]
    out: dict[str, list] = {}
    with UserSimClient([a, b], timeout_s=10) as client:
        threads = [threading.Thread(target=lambda p=p: out.__setitem__(p, client.complete(
            dialogue_requests(50, prefix=p)))) for p in ("x", "y")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert client.stats()["user_sim/turns"] == 100
    for prefix in ("x", "y"):
        assert_all_answered(out[prefix], dialogue_requests(50, prefix=prefix))


@pytest.mark.processes
def test_server_killed_mid_batch_all_dialogues_answered_by_the_other(sims):
    slow = ("--inject-latency-ms", "100", "--inject-latency-sigma", "0.3")
    victim, survivor = sims.start(*slow), sims.start(*slow)
    sims.wait_ready(victim, survivor)
    requests = dialogue_requests(200)
    with UserSimClient([victim, survivor], timeout_s=10, max_in_flight=16, backoff_s=0.05) as client:
        box: dict[str, list] = {}
        worker = threading.Thread(target=lambda: box.__setitem__("results", client.complete(requests)))
        worker.start()
        while (stats := client.stats())[f"user_sim/{name(victim)}/successes"] < 20:
            assert worker.is_alive(), "the batch finished before the server could be killed"
            in_flight = stats[f"user_sim/{name(victim)}/in_flight"] + stats[f"user_sim/{name(survivor)}/in_flight"]
            assert in_flight <= 16
            time.sleep(0.01)
        sims.kill(victim)
        worker.join(timeout=60)
        stats = client.stats()
    results = box["results"]
    assert_all_answered(results, requests)
    counts = replies_by_instance(results)
    assert 20 <= counts[name(victim)] < 100 and counts[name(survivor)] > 100, counts
    assert stats[f"user_sim/{name(victim)}/failures_connection"] >= 1
    assert stats[f"user_sim/{name(victim)}/down"] == 1.0
    assert stats["user_sim/failovers"] >= 1


@pytest.mark.processes
def test_hanging_server_does_not_stall_the_batch(sims):
    hang, a = sims.urls["hang"], sims.urls["a"]
    requests = dialogue_requests(60)
    timeout_s = 1.5
    with UserSimClient([hang, a], timeout_s=timeout_s, backoff_s=0.05) as client:
        start = time.monotonic()
        results = client.complete(requests)
        elapsed = time.monotonic() - start
        stats = client.stats()
    assert_all_answered(results, requests)
    assert elapsed < timeout_s + 3.0, elapsed
    assert replies_by_instance(results) == {name(a): 60}
    assert stats[f"user_sim/{name(hang)}/failures_timeout"] >= 1
    assert stats[f"user_sim/{name(hang)}/down"] == 1.0


@pytest.mark.processes
@pytest.mark.parametrize("fault, counter", [("garbage", "failures_garbage"), ("error", "failures_http")])
def test_bad_answers_are_retried_elsewhere_and_counted(sims, fault, counter):
    bad, a = sims.urls[fault], sims.urls["a"]
    requests = dialogue_requests(40)
    with UserSimClient([bad, a], timeout_s=5, backoff_s=0.02) as client:
        results = client.complete(requests)
        stats = client.stats()
        client.reset_stats()
        assert client.stats()["user_sim/retries"] == 0
    assert_all_answered(results, requests)
    assert replies_by_instance(results) == {name(a): 40}
    bad_failures = stats[f"user_sim/{name(bad)}/{counter}"]
    assert bad_failures >= 1 and bad_failures == stats[f"user_sim/{name(bad)}/failures"]
    assert stats["user_sim/retries"] == stats["user_sim/failovers"] == bad_failures
    assert stats[f"user_sim/{name(a)}/retries"] == stats[f"user_sim/{name(a)}/failovers"] == bad_failures
    assert stats[f"user_sim/{name(bad)}/retries"] == stats[f"user_sim/{name(bad)}/failovers"] == 0
    assert max(r.attempts for r in results) == 2


@pytest.mark.processes
def test_rejected_request_is_not_retried_or_blamed_on_the_server(sims):
    a = sims.urls["a"]
    with UserSimClient(a, model="no-such-model", timeout_s=5) as client:
        results = client.complete(dialogue_requests(3))
        stats = client.stats()
    assert all(isinstance(r, TurnFailure) and r.attempts == 1 and "rejected" in r.reason for r in results)
    assert "404" in results[0].errors[0]
    assert stats[f"user_sim/{name(a)}/down"] == 0.0 and stats[f"user_sim/{name(a)}/failures"] == 0


@pytest.mark.processes
def test_down_instance_is_used_again_after_a_probe(sims):
    a = sims.urls["a"]
    port = free_port()
    flaky = sims.start(port=port)
    sims.wait_ready(flaky)
    with UserSimClient([flaky, a], timeout_s=5, probe_interval_s=0.2, backoff_s=0.02) as client:
        assert_all_answered(client.complete(dialogue_requests(20)), dialogue_requests(20))
        sims.kill(flaky)
        results = client.complete(dialogue_requests(40))
        assert_all_answered(results, dialogue_requests(40))
        assert replies_by_instance(results) == {name(a): 40}
        assert client.stats()[f"user_sim/{name(flaky)}/down"] == 1.0
        sims.start(port=port)
        sims.wait_ready(flaky)
        deadline = time.monotonic() + 10
        while client.stats()[f"user_sim/{name(flaky)}/down"] == 1.0:
            assert time.monotonic() < deadline, "the restarted instance was never probed back up"
            time.sleep(0.05)
        results = client.complete(dialogue_requests(40))
    assert_all_answered(results, dialogue_requests(40))
    # used again: its share of the 40 rides on the load scores (its useful share still counts the failures, and a
    # slow first reply of the cold server lifts its latency estimate), so on a loaded box it may get only a few
    assert replies_by_instance(results).get(name(flaky), 0) >= 1


@pytest.mark.processes
def test_api_key_is_sent_and_a_missing_key_is_a_rejection(sims, monkeypatch):
    auth = sims.urls["auth"]
    monkeypatch.delenv("SEAD_USER_SIM_API_KEY", raising=False)
    with UserSimClient(auth, api_key="s3cret", timeout_s=5) as client:
        assert_all_answered(client.complete(dialogue_requests(4)), dialogue_requests(4))
    with monkeypatch.context() as env:  # no key in the config: the environment's is used
        env.setenv("SEAD_USER_SIM_API_KEY", "s3cret")
        with UserSimClient(auth, timeout_s=5) as client:
            assert_all_answered(client.complete(dialogue_requests(2)), dialogue_requests(2))
    with UserSimClient(auth, timeout_s=5) as client:
        results = client.complete(dialogue_requests(2))
    assert all(isinstance(r, TurnFailure) and r.attempts == 1 and "401" in r.reason for r in results)


@pytest.mark.processes
def test_deadline_bounds_turns_queued_behind_a_hanging_server(sims):
    hang = sims.urls["hang"]
    with UserSimClient(hang, timeout_s=30, deadline_s=1.0, max_in_flight=2) as client:
        start = time.monotonic()
        results = client.complete(dialogue_requests(10))
        elapsed = time.monotonic() - start
        stats = client.stats()
    assert elapsed < 2.0, elapsed
    assert all(isinstance(r, TurnFailure) and "deadline" in r.reason for r in results)
    assert sum("queued" in e for r in results for e in r.errors) == 8
    assert stats[f"user_sim/{name(hang)}/requests"] == 2
    assert stats[f"user_sim/{name(hang)}/failures"] == 0, "a deadline cut is not the server's fault"


@pytest.mark.processes
def test_many_concurrent_requests_are_all_answered_and_acomplete_takes_the_same_path(sims):
    """100 turns in flight over two instances, all answered; `acomplete`, awaited on the client's loop through
    `run_on_loop` (the async rollout loop), answers single requests through the same path, and both refuse misuse:
    awaiting off the client's loop, and any call after close (the connection bound itself:
    tests/llm_agent/user_sim/test_http_pool.py)."""
    urls = sims.urls
    with UserSimClient([urls["a"], urls["b"]], max_in_flight=100, timeout_s=10) as client:
        results = client.complete(dialogue_requests(100))
        stats = client.stats()

        async def singles():
            return await asyncio.gather(*(client.acomplete(r) for r in dialogue_requests(3, prefix="one")))

        single = client.run_on_loop(singles())
        with pytest.raises(RuntimeError, match="client's own loop"):
            asyncio.run(client.acomplete(dialogue_requests(1)[0]))
    assert all(isinstance(r, TurnReply) for r in results)
    assert [r.dialogue_id for r in results] == [f"d{i}" for i in range(100)]
    assert stats[f"user_sim/{name(urls['a'])}/requests"] > 0 and stats[f"user_sim/{name(urls['b'])}/requests"] > 0
    assert [r.dialogue_id for r in single] == ["one0", "one1", "one2"]
    assert all(isinstance(r, TurnReply) for r in single)
    with pytest.raises(RuntimeError, match="after close"):
        client.run_on_loop(singles())


@pytest.mark.processes
def test_a_saturated_server_sheds_load_and_every_turn_is_still_answered(tmp_path):
    """A server with one worker thread and a queue of one answers most of 40 concurrent turns with 503 `overloaded`:
    each such turn is sent again (not an attempt used up, not a failure of the instance) until answered."""
    servers = SimServers(tmp_path)
    try:
        url = servers.start("--max-concurrency", "1", "--max-queue", "1")
        servers.wait_ready(url)
        with UserSimClient([url], max_attempts=2, timeout_s=20, backoff_s=0.01) as client:
            results = client.complete(dialogue_requests(40))
            stats = client.stats()
    finally:
        servers.stop_all()
    assert all(isinstance(r, TurnReply) for r in results), [r for r in results if not isinstance(r, TurnReply)][:2]
    assert stats[f"user_sim/{name(url)}/failures_overloaded"] > 0  # the server did shed load
    assert stats[f"user_sim/{name(url)}/marked_down"] == 0
    assert max(r.attempts for r in results) == 1
