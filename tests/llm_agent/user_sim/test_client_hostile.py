"""The simulator client against hostile answers (issue 29, items 1, 2, 5 and 10): deeply nested JSON in a 200, a
503 or /v1/models, lone surrogates in a reply, replies that fail the tag protocol, and a slow 503 "overloaded".
Each hostile instance is a loopback server in this process (tests/helpers/hostile_openai.py) beside a healthy one."""
from __future__ import annotations

import time

import pytest

from llm_agent.user_sim.client import SimulatorCheckError, TurnFailure, TurnReply, TurnRequest, UserSimClient

from tests.helpers.hostile_openai import SLOW_S, HostileOpenAIServer


def _requests(n: int, avoid: tuple[str, ...] = ()) -> list[TurnRequest]:
    extra = {"avoid": avoid} if avoid else {}
    return [TurnRequest(f"d{i}#0", [{"role": "system", "content": "persona"}, {"role": "user", "content": "hi"}],
                        seed=i, **extra) for i in range(n)]


def _name(url: str) -> str:
    return url.split("//", 1)[1]


@pytest.mark.parametrize("mode, model", [("nested", "m"), ("nested_503", "m"), ("nested", None)],
                         ids=["nested-200", "nested-503", "nested-models"])
def test_a_deeply_nested_reply_fails_over_to_the_healthy_instance(mode, model):
    with HostileOpenAIServer(mode) as bad, HostileOpenAIServer("ok", content="fine") as good:
        with UserSimClient([bad.url, good.url], model=model, timeout_s=5, backoff_s=0.01) as client:
            results = client.complete(_requests(8))
            stats = client.stats()
    assert all(isinstance(r, TurnReply) and r.text == "fine" for r in results), results
    assert stats[f"user_sim/{_name(bad.url)}/failures"] >= 1


def test_the_start_up_check_names_an_instance_whose_model_list_is_nested_too_deep():
    with HostileOpenAIServer("nested") as bad, HostileOpenAIServer("ok") as good:
        with UserSimClient([bad.url, good.url], timeout_s=5) as client:
            with pytest.raises(SimulatorCheckError) as err:
                client.check_instances(timeout_s=5)
    assert bad.url.split("//")[1] in str(err.value) and good.url.split("//")[1] not in str(err.value)
    assert "nested" in str(err.value)


def test_lone_surrogates_in_a_reply_are_replaced_before_anyone_reads_it():
    with HostileOpenAIServer("surrogate") as server:
        with UserSimClient([server.url], model="m", timeout_s=5) as client:
            reply = client.complete(_requests(1))[0]
    assert isinstance(reply, TurnReply) and reply.text == "hello \ufffd there"
    reply.text.encode("utf-8")  # what a tokenizer, a cache file or a log needs
    direct = TurnReply("d#0", "a \udfff b", "x:1", 0.1, 1)  # any SimulatorClient's reply: the contract cleans it
    assert direct.text == "a \ufffd b"


def test_a_request_avoids_the_instances_whose_replies_the_caller_refused():
    with HostileOpenAIServer("ok", content="one") as first, HostileOpenAIServer("ok", content="two") as second:
        with UserSimClient([first.url, second.url], model="m", timeout_s=5) as client:
            answers = client.complete(_requests(10, avoid=(_name(first.url),)))
            stats = client.stats()
    assert {a.text for a in answers} == {"two"} and first.requests == 0
    assert stats[f"user_sim/{_name(first.url)}/failures_protocol"] == 10


def test_an_instance_whose_replies_fail_the_protocol_loses_its_share():
    """After protocol failures are reported, fresh requests mostly go to the other instance."""
    with HostileOpenAIServer("ok", content="untagged") as bad, HostileOpenAIServer("ok", content="ok") as good:
        with UserSimClient([bad.url, good.url], model="m", timeout_s=5) as client:
            for _ in range(3):
                client.complete(_requests(4, avoid=(_name(bad.url),)))
            before = bad.requests
            client.complete(_requests(40))
    assert bad.requests - before <= 8, f"{bad.requests - before} of 40 fresh requests went to the refused instance"


def test_a_slow_overloaded_answer_cannot_stretch_a_turn_past_its_bounds():
    """Sheds are re-sent for at most `timeout_s` of wall time; then an overloaded answer is a failed attempt.
    Bound: one timeout of sheds plus `max_attempts` attempts, plus the backoff pauses."""
    timeout_s, attempts = 1.0, 2
    with HostileOpenAIServer("overloaded_slow") as server:
        with UserSimClient([server.url], model="m", timeout_s=timeout_s, max_attempts=attempts,
                           backoff_s=0.2) as client:
            start = time.monotonic()
            result = client.complete(_requests(1))[0]
            took = time.monotonic() - start
    assert isinstance(result, TurnFailure) and "overloaded" in " ".join(result.errors)
    assert took <= (attempts + 1) * timeout_s + 1.0, f"one turn took {took:.1f} s ({server.requests} requests)"
    assert server.requests >= 2 and SLOW_S < timeout_s


@pytest.mark.parametrize("name, value", [("timeout_s", float("nan")), ("timeout_s", float("inf")),
                                         ("deadline_s", float("nan")), ("deadline_s", float("inf")),
                                         ("backoff_s", float("nan")), ("probe_interval_s", float("inf"))])
def test_non_finite_client_settings_are_refused(name, value):
    with pytest.raises(ValueError, match=name):
        UserSimClient(["http://127.0.0.1:9"], **{name: value})
